"""Several trainer processes (accelerate launch): this process's place, batch sharding, gradient
sync, sharded-model wrappers and rank-0 I/O."""

from grouprl.runtime.distributed.dist import SINGLE, Dist, setup

__all__ = ["SINGLE", "Dist", "setup"]
