"""``horovod.common.elastic``'s names: State, ObjectState, run_fn."""
from hvdlite.elastic import ObjectState, State, run_fn

__all__ = ["State", "ObjectState", "run_fn"]
