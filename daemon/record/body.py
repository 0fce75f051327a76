"""What every ledger entry body is: a pydantic model that states its kind, actor and parents.

Reading is tolerant, writing is strict. A body read from the ledger may carry fields a later
tally added (`extra="allow"`, kept as they are) and may lack fields added after it was written
(those have defaults). A body a writer builds has exactly its kind's fields: `written()`
refuses any other, and leaves out only the few its kind writes only when they hold something
(`OPTIONAL`, when the writer did not set them), so a writer cannot drift from its kind.
Types are exact both ways (`strict=True`): JSON has no coercions, and neither does the record.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

CLIENT = "<client>"
"""In `ACTORS`: the entry's actor is the name of the client that caused it."""


class Body(BaseModel):
    """The body of one entry kind. Subclasses set the four class variables below."""

    model_config = ConfigDict(extra="allow", strict=True)

    KIND: ClassVar[str]
    ACTORS: ClassVar[tuple[str, ...]]
    """Who writes it: "engine", "daemon", "pool", "tool", or `CLIENT` (the client's name)."""
    PARENTS: ClassVar[tuple[str, ...]] = ()
    """The kinds its `parent` may be; () for an entry with no parent."""
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    """Fields written only when they hold something (absent otherwise, as they always were)."""

    @classmethod
    def read(cls, data: object) -> Self:
        """A body as the ledger holds it (tolerant of later fields; raises ValidationError)."""
        return cls.model_validate(data, strict=True)

    @classmethod
    def parsed(cls, data: object) -> Self | None:
        """`read`, or None for a body that does not fit (`tally ledger verify --deep` names
        those): for a reader that counts what it can and skips the rest."""
        try:
            return cls.read(data)
        except ValidationError:
            return None

    def written(self) -> dict[str, Any]:
        """The body to witness: every field its kind writes, nothing its kind does not."""
        name = type(self).__name__
        if self.model_extra:
            raise TypeError(f"{self.KIND} ({name}): unknown fields {sorted(self.model_extra)}")
        data = self.model_dump(mode="python", by_alias=True)
        for field in self.OPTIONAL - self.model_fields_set:
            data.pop(field, None)
        return data


class Part(BaseModel):
    """A nested object of a body: tolerant and exact like `Body`, with no kind of its own."""

    model_config = ConfigDict(extra="allow", strict=True)
