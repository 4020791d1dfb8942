"""Shared pieces of the request models."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

MAX_INT = 2**31 - 1
# 2^53 - 1: the largest integer every JSON reader holds exactly (a JavaScript number; a JSON Schema validator
# compares as doubles, so a larger bound would let it call 2^63 + 100 "valid"). Random seeds stay below it.
MAX_SEED = 2**53 - 1
# strict: JSON types as declared (no "10" for an integer); NaN / Infinity refused; unknown keys ignored
STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

Seed = Annotated[int | None, Field(ge=0, le=MAX_SEED, description="same seed, same request → same tokens")]
StopString = Annotated[str, Field(min_length=1)]


def only_off(tp: Any, off: Any, why: str, schema: dict) -> Any:
    """A parameter of type `tp` this server accepts only at its neutral value `off`: refused with `why`
    otherwise, and the OpenAPI schema says so (`schema` narrows the field's JSON schema to that value)."""

    def check(v: Any) -> Any:
        if v is not None and v != off:
            raise ValueError(why)
        return v

    return Annotated[tp | None, AfterValidator(check), Field(json_schema_extra=schema)]


def off_flag(why: str) -> Any:
    """A boolean accepted only as false."""
    return Annotated[bool | None, AfterValidator(lambda v: _refuse_true(v, why)),
                     Field(json_schema_extra={"enum": [False, None]})]


def _refuse_true(v: bool | None, why: str) -> bool | None:
    if v:
        raise ValueError(why)
    return v


def null_only(why: str) -> Any:
    """A field accepted only when absent or null."""

    def check(v: Any) -> Any:
        if v is not None:
            raise ValueError(why)
        return v

    return Annotated[Any, AfterValidator(check), Field(json_schema_extra={"type": "null"})]
