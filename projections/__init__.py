"""SQLite read models folded from the RP_EVENTS stream: `Projector`, `ReadModel`, `replay`."""

from projections.projector import Projector
from projections.readmodel import ReadModel
from projections.replay import ReplayError, replay

__all__ = ["Projector", "ReadModel", "ReplayError", "replay"]
