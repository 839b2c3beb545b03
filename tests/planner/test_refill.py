"""Generation that refills its slots, as the planner prices it: the slot schedule by
hand, the simulated steps against the schedule of sampled lengths, and the cost model's
price of a refilling call against waves."""
from __future__ import annotations

import random

import numpy as np
import pytest

from planner.cost.cost_model import CostModel
from planner.errors import PlanError
from planner.graph.dataflow import MFC
from planner.graph.lengths import STOP_CHECK_EVERY, GenLengths
from planner.graph.refill import refill_shape, release_time, slot_schedule
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

CPU = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu"))
TINY = model_presets()["tiny-llama"]
#: tiny-reason's shape: responses of 103 tokens on average, 13 % at the cap of 240
TAIL = GenLengths(max_len=240, mean=103.0)


def gen(n=32, refill=True, lengths=TAIL, gen_len=240):
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
               prompt_len=8, gen_len=gen_len, input_keys=("prompts",), output_keys=("seqs",),
               lengths=lengths, refill=refill)


def test_release_time_by_hand():
    assert release_time(np.array(0), np.array(3), 20) == STOP_CHECK_EVERY
    assert release_time(np.array(8), np.array(8), 20) == 16        # a check at its end
    assert release_time(np.array(3), np.array(20), 20) == 23       # the cap: no check
    assert release_time(np.array(1), np.array(5), 6) == 7          # the cap comes first


def test_slot_schedule_by_hand():
    assert slot_schedule([3, 20, 2], 2, 20) == [(0, 8), (0, 20), (8, 16)]
    # one slot: one after another; four slots for three rows: all at once
    assert slot_schedule([3, 3], 1, 20) == [(0, 8), (8, 16)]
    assert [a for a, _ in slot_schedule([5, 9, 2], 4, 20)] == [0, 0, 0]


def test_without_a_distribution_refill_is_waves():
    assert refill_shape(gen(lengths=None, gen_len=10), 2, 5, 1) == (27.0, 3.0)


@pytest.mark.parametrize("slots,rows,dp", [(4, 16, 1), (8, 32, 2), (2, 32, 1)])
def test_simulated_steps_match_the_schedule_of_sampled_lengths(slots, rows, dp):
    """The planner's expected steps are those of the runtime's schedule over lengths
    drawn from the distribution (the slowest of dp ranks), within 5 %."""
    m = gen(n=rows * dp)
    p = np.asarray(TAIL.pmf())
    rnd = random.Random(5)
    ends = []
    for _ in range(300):
        per_rank = [max(f for _, f in slot_schedule(
            rnd.choices(range(1, 241), weights=p, k=rows), slots, 240)) for _ in range(dp)]
        ends.append(max(per_rank))
    steps, admits = refill_shape(m, slots, rows, dp)
    assert steps + 1 == pytest.approx(np.mean(ends), rel=0.05)
    assert 1 <= admits <= rows - slots + 1


def test_refill_takes_fewer_steps_than_waves_on_a_long_tail():
    """Waves of 8 rows each decode to their longest (near the cap: 13 % of responses
    reach it); refilled slots finish about when the work divided by the slots does."""
    from planner.graph.lengths import expected_wave_tokens

    steps, _ = refill_shape(gen(), 8, 32, 1)
    waves = 4 * (expected_wave_tokens(gen(), 8) - 1)
    mean = TAIL.expected()
    assert steps < 0.75 * waves
    assert steps > 32 * mean / 8                   # at least the work over the slots


def test_the_cost_model_prices_refill_below_waves_and_alike_without_a_tail():
    cost = CostModel(CPU)
    one = DeviceMesh(first_gpu=0, n_gpus=1)
    t_refill = cost.mfc_cost(gen(), TINY, "lm", one, Layout(), 4).time_s
    t_waves = cost.mfc_cost(gen(refill=False), TINY, "lm", one, Layout(), 4).time_s
    assert t_refill < 0.85 * t_waves
    flat_r = cost.mfc_cost(gen(lengths=None), TINY, "lm", one, Layout(), 4).time_s
    flat_w = cost.mfc_cost(gen(lengths=None, refill=False), TINY, "lm", one, Layout(), 4).time_s
    assert flat_r == pytest.approx(flat_w, rel=0.02)


def test_only_a_generate_call_refills():
    with pytest.raises(PlanError, match="refills"):
        MFC(name="ref.inference", role="ref", kind="inference", n_seqs=4, prompt_len=8,
            gen_len=8, input_keys=("seqs",), output_keys=("lp",), refill=True)
