"""Imported once, by the fork server that the rank pool's workers are forked from (tests/rank_pool.py): it sets
the server up as a rank process before torch is imported (one thread, offline, the package's deprecations as
errors), then imports what every scenario needs. It dies with pytest, and its workers with it."""

from tests import rank_pool

rank_pool.die_with_parent()
rank_pool.set_up_as_a_rank(rank_pool.offline_env())
rank_pool.preload()
