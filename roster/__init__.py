"""The roster: keyword lanes, model tiers, pool members and policy, as TOML."""

from roster.loading import (
    RosterError,
    RosterProblem,
    default_roster_path,
    dump_roster,
    load_roster,
    load_roster_text,
)
from roster.models import Budget, Lane, Member, Policy, Roster, Sampling, Tiers, resolve_model_path

__all__ = [
    "Budget",
    "Lane",
    "Member",
    "Policy",
    "Roster",
    "RosterError",
    "RosterProblem",
    "Sampling",
    "Tiers",
    "default_roster_path",
    "dump_roster",
    "load_roster",
    "load_roster_text",
    "resolve_model_path",
]
