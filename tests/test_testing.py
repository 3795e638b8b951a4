import pytest

from relibra_torch.testing import RankFailure, RankPool, run_on_ranks
import _rank_fns


def test_run_on_ranks_returns_rank_results():
    assert run_on_ranks(_rank_fns.all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_failure_reports_traceback_and_does_not_hang():
    with pytest.raises(RankFailure) as info:
        with RankPool(3, timeout_s=60, grace_s=2) as pool:
            pool.run(_rank_fns.fail_on_rank_one)
    text = str(info.value)
    assert "rank 1" in text and "boom on rank one" in text
    assert "did not finish" in text


def test_pool_reused_across_calls():
    with RankPool(2) as pool:
        assert pool.run(_rank_fns.all_reduce_rank) == [1.0, 1.0]
        assert pool.run(_rank_fns.all_reduce_rank) == [1.0, 1.0]
