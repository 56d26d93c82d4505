"""The base of every config section: what `dfca.config` and each algorithm's own section (dfca.algorithms) share.

An algorithm's file declares its section as a `Strict` model; `dfca.config` composes the experiment schema from
the registry's sections. This module imports neither of them, so both can import it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors; every float must be finite (NaN and infinity are refused as the field's error)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
