"""state: the plan's identity and where a loader is in it: the spec, the cursor, the
state schema, its verification, elastic remapping onto another data-parallel layout,
atomic per-rank state files.

Owns: ``PlanSpec`` (the plan's identity), ``Cursor`` (a loader's place in it),
``load_state_file``, ``save_state_file``, ``state_path``, ``verify_state``, ``restore``,
``make_state``, ``fingerprint_of``, ``elastic_view``.

May import: ``wds_pad.index``, ``wds_pad.io``, ``wds_pad.core``, ``wds_pad.errors``.
Nothing of stream or cli.
"""

from .cursor import Cursor, Position, ShardProgress, WorkerPosition, epoch_length
from .elastic import ElasticView, elastic_view
from .files import load_state_file, save_state_file, state_path
from .schema import STATE_FORMAT, STATE_VERSION, fingerprint_of
from .spec import PlanSpec
from .verify import make_state, restore, verify_state

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "Cursor",
    "ElasticView",
    "PlanSpec",
    "Position",
    "ShardProgress",
    "WorkerPosition",
    "elastic_view",
    "epoch_length",
    "fingerprint_of",
    "load_state_file",
    "make_state",
    "restore",
    "save_state_file",
    "state_path",
    "verify_state",
]
