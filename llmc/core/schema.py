"""The base of every configuration section: pydantic, unknown keys refused."""
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
