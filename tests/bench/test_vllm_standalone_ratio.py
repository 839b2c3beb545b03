"""The arithmetic of realign/bench/studies/generate_vllm_standalone_ratio.py: the sides'
alternating order, a round's ratio of realign's tokens/s over standalone vLLM's with and
without the weight update in realign's time, one TP's summary over its raw rounds, and
the standalone engine's arguments."""
from __future__ import annotations

import pytest

from realign.bench.studies import generate_vllm_standalone_ratio as study

pytestmark = pytest.mark.pure


def a_round(order: list[str], load_s: float, generate_s: float, alone_s: float,
            tokens: int = 100) -> dict:
    return {"order": order, "load1": 1.5,
            "realign": {"load_s": load_s, "generate_s": generate_s, "tokens": tokens,
                        "bytes": 10},
            "standalone": {"s": alone_s, "tokens": tokens}}


def test_sides_alternate() -> None:
    assert [study.side_order(r) for r in range(3)] == [
        ["realign", "standalone"], ["standalone", "realign"], ["realign", "standalone"]]


def test_a_round_with_and_without_the_weight_update() -> None:
    r = study.round_ratios(a_round([], load_s=0.1, generate_s=0.9, alone_s=0.9))
    assert r["with_update"] == pytest.approx(0.9)
    assert r["generation_only"] == pytest.approx(1.0)
    # tokens count on each side: realign generated half of standalone's in the same time
    row = a_round([], load_s=0.0, generate_s=1.0, alone_s=1.0)
    row["realign"]["tokens"] = 50
    assert study.round_ratios(row) == {"with_update": 0.5, "generation_only": 0.5}


def test_one_tp_summarised_over_its_rounds() -> None:
    rows = [a_round(study.side_order(0), 0.2, 0.8, 0.8),     # 0.8 and 1.0
            a_round(study.side_order(1), 0.1, 1.0, 0.9),     # 0.818 and 0.9
            a_round(study.side_order(2), 0.0, 0.5, 0.6)]     # 1.2 and 1.2
    res = {"rounds": rows, "tokens": {"realign": [[1, 2], [3, 4], [5]],
                                      "standalone": [[1, 2], [3, 5], [5]]}}
    s = study.summarize_tp(res)
    assert s["ratio_with_update"]["median"] == pytest.approx(0.9 / 1.1)
    assert s["ratio_with_update"]["min"] == pytest.approx(0.8)
    assert s["ratio_with_update"]["max"] == pytest.approx(1.2)
    assert s["ratio_generation_only"]["median"] == pytest.approx(1.0)
    assert s["ratio_generation_only"]["n"] == 3
    assert [r["with_update"] for r in s["per_round"]] == pytest.approx([0.8, 0.9 / 1.1, 1.2])
    assert s["tokens_per_s"]["standalone"]["median"] == pytest.approx(100 / 0.8)
    assert s["tokens_per_s"]["realign_with_update"]["median"] == pytest.approx(100.0)
    assert s["tokens_per_s"]["realign_generation_only"]["max"] == pytest.approx(200.0)
    assert s["weight_update_s"]["median"] == pytest.approx(0.1)
    assert s["load1"]["median"] == 1.5
    assert (s["greedy_equal_rows"], s["rows"]) == (2, 3)


def test_standalone_engine_arguments_follow_the_tp() -> None:
    one = study.standalone_args(1, 80, enforce_eager=True)
    two = study.standalone_args(2, 80, enforce_eager=True)
    assert (one["tensor_parallel_size"], one["distributed_executor_backend"]) == (1, "uni")
    assert (two["tensor_parallel_size"], two["distributed_executor_backend"]) == (2, "mp")
    assert one["kv_cache_memory_bytes"] == study.KV_CACHE_GIB * 2 ** 30
    assert one["max_model_len"] == 80 and one["enable_prefix_caching"] is False
    assert "worker_extension_cls" not in two
