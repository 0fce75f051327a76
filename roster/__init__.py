"""The roster: keyword lanes, model tiers, pool members and policy, as TOML."""

from roster.models import Budget, Lane, Member, Policy, Roster, Sampling, Tiers, resolve_model_path

__all__ = [
    "Budget",
    "Lane",
    "Member",
    "Policy",
    "Roster",
    "Sampling",
    "Tiers",
    "resolve_model_path",
]
