"""Shared pieces of the request models."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

from engine.params import BOUNDS

MAX_INT = 2**31 - 1
# strict: JSON types as declared (no "10" for an integer); NaN / Infinity refused; unknown keys ignored
STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

Seed = Annotated[int | None, Field(**BOUNDS["seed"].field(), description="same seed, same request → same tokens")]
StopString = Annotated[str, Field(min_length=1)]


def bound(name: str, **override) -> dict:
    """`Field` limits of a sampling parameter from the engine's table (engine.params.BOUNDS); `override` where
    an API's range differs (an off value of its own, an integer the JSON schema caps at MAX_INT)."""
    return BOUNDS[name].field(**override)


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
