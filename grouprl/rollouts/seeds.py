"""Seeds of single samples: a run seed, a group id and an index give one 63-bit seed.

rollout.seeding = "per_sample" draws each completion (each turn of an episode) from a generator of
its own, seeded from these keys (policies/text/engines/seeded.py), so a group's samples depend on
its id and the weights only, never on the batch split, the process count or a background thread.
Several processes with global seeding seed torch's RNG from (seed, first group id, rank).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # torch.Generator.manual_seed takes any int; keep it non-negative and 64-bit safe


def _seed_of(*key: int) -> int:
    """A 63-bit seed from a tuple of ints (blake2b of their text)."""
    text = ":".join(str(int(k)) for k in key)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def sample_seed(seed: int, group_id: int, index: int) -> int:
    """The seed of sample `index` of group `group_id` in a run seeded `seed` (a 63-bit int)."""
    return _seed_of(seed, group_id, index)


def turn_seed(seed: int, group_id: int, index: int, turn: int) -> int:
    """The seed of turn `turn` of episode `index` of group `group_id` (multi-turn rollouts: each
    turn is a generate call of its own, so each gets its own stream)."""
    return _seed_of(seed, group_id, index, turn)


def group_seeds(seed: int, group_ids: list[int], group_size: int | list[int]) -> list[int]:
    """One seed per completion row, rows ordered group by group (G consecutive rows per group);
    group_size: one G for all groups, or one per group (rollout.budget allocate)."""
    sizes = group_sizes(group_size, len(group_ids))
    return [sample_seed(seed, int(g), j) for g, n in zip(group_ids, sizes) for j in range(n)]


def group_sizes(group_size: int | list[int], n_groups: int) -> list[int]:
    """One G per group from an int (the same for all) or a list (checked: one per group, >= 1)."""
    if isinstance(group_size, int):
        sizes = [group_size] * n_groups
    else:
        sizes = [int(g) for g in group_size]
        if len(sizes) != n_groups:
            raise ValueError(f"{len(sizes)} group sizes for {n_groups} groups: need one per group")
    if any(g < 1 for g in sizes):
        raise ValueError(f"every group_size must be >= 1, got {sizes}")
    return sizes
