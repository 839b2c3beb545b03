"""Dataflow graphs: every algorithm's builder, edges derived from keys, and the
errors a user or a builder can make."""
from __future__ import annotations

import pytest

from planner.errors import PlanError
from planner.graph.algorithms import ALGORITHMS, DATASET_KEYS, BatchShape, build_graph
from planner.graph.dataflow import MFC, DataflowGraph

pytestmark = pytest.mark.pure

SHAPE = BatchShape(prompts_per_step=8, samples_per_prompt=4, prompt_len=16, gen_len=32,
                   ppo_minibatches=2, ppo_epochs=3)


def edges(g: DataflowGraph) -> set[tuple[str, str]]:
    return set(g.to_networkx().edges)


def kinds(g: DataflowGraph) -> dict[str, str]:
    return {m.name: m.kind for m in g.mfcs}


def by_name(g: DataflowGraph) -> dict[str, MFC]:
    return {m.name: m for m in g.mfcs}


def test_every_algorithm_is_in_the_table_with_its_data():
    assert set(ALGORITHMS) == {"ppo", "grpo", "remax", "reinforce_pp", "rloo", "dpo", "sft",
                               "rm", "rejection_sampling", "online_dpo", "dapo", "gspo",
                               "dr_grpo"}
    for name, spec in ALGORITHMS.items():
        roles = set(spec.required_roles) | set(spec.optional_roles)
        g = build_graph(name, SHAPE, roles - ({"reward"} if name in ("dpo", "sft") else set()))
        assert g.dataset_keys() == [spec.dataset_key] == [DATASET_KEYS[spec.data_kind]]
        assert spec.generates == any(m.kind == "generate" for m in g.mfcs)


@pytest.mark.parametrize("alg,roles", [
    ("grpo", {"actor"}), ("rloo", {"actor", "reward"}), ("reinforce_pp", {"actor"}),
    ("remax", {"actor"}), ("remax", {"actor", "reward"}),
    ("ppo", {"actor", "critic", "reward"})])
def test_rl_graphs_without_a_reference_model(alg, roles):
    """No ref model: no reference call, and no training call reads ref_logprobs; the
    rest of the graph is the one with a reference, minus that call."""
    g = build_graph(alg, SHAPE, roles)
    full = build_graph(alg, SHAPE, roles | {"ref"})
    assert "ref" not in g.roles()
    assert all("ref_logprobs" not in m.input_keys for m in g.mfcs)
    assert [m.name for m in g.mfcs] == [m.name for m in full.mfcs if m.name != "ref.inference"]
    for m, f in zip(g.mfcs, (f for f in full.mfcs if f.name != "ref.inference")):
        assert m.input_keys == tuple(k for k in f.input_keys if k != "ref_logprobs")


def test_ppo_graph():
    g = build_graph("ppo", SHAPE, {"actor", "critic", "ref", "reward"})
    assert [m.name for m in g.mfcs] == [
        "actor.generate", "reward.inference", "ref.inference", "critic.inference",
        "actor.train", "critic.train"]
    assert kinds(g) == {"actor.generate": "generate", "reward.inference": "inference",
                        "ref.inference": "inference", "critic.inference": "inference",
                        "actor.train": "train", "critic.train": "train"}
    scorers = ("reward.inference", "ref.inference", "critic.inference")
    trains = ("actor.train", "critic.train")
    expected = ({("actor.generate", s) for s in scorers + trains}
                | {(s, t) for s in scorers for t in trains})
    assert edges(g) == expected
    assert g.dataset_keys() == ["prompts"]
    assert g.trainable_roles() == {"actor", "critic"}
    assert g.roles() == ["actor", "reward", "ref", "critic"]
    # The edge carries the keys read: actor.train reads seqs and logprobs from generate.
    assert sorted(g.to_networkx().edges["actor.generate", "actor.train"]["keys"]) == [
        "logprobs", "seqs"]
    # deps() are the same edges, by index.
    names = [m.name for m in g.mfcs]
    assert {(names[d], names[i]) for i, ds in enumerate(g.deps()) for d in ds} == expected
    m = by_name(g)
    assert all(x.n_seqs == 32 for x in g.mfcs)  # 8 prompts x 4 samples
    assert all((x.prompt_len, x.gen_len, x.seq_len) == (16, 32, 48) for x in g.mfcs)
    assert (m["actor.train"].n_minibatches, m["actor.train"].n_epochs) == (2, 3)
    assert (m["critic.train"].n_minibatches, m["critic.train"].n_epochs) == (2, 3)


def test_ppo_requires_a_reward_model():
    with pytest.raises(PlanError, match="reward") as e:
        build_graph("ppo", SHAPE, {"actor", "critic", "ref"})
    assert e.value.field == "models"


@pytest.mark.parametrize("alg", ["grpo", "reinforce_pp", "rloo"])
@pytest.mark.parametrize("with_rm", [False, True])
def test_critic_free_graphs(alg, with_rm):
    roles = {"actor", "ref"} | ({"reward"} if with_rm else set())
    g = build_graph(alg, SHAPE, roles)
    names = ["actor.generate"] + (["reward.inference"] if with_rm else []) + [
        "ref.inference", "actor.train"]
    assert [m.name for m in g.mfcs] == names
    scorers = ["ref.inference"] + (["reward.inference"] if with_rm else [])
    assert edges(g) == ({("actor.generate", s) for s in scorers}
                        | {(s, "actor.train") for s in scorers}
                        | {("actor.generate", "actor.train")})
    assert g.dataset_keys() == ["prompts"]
    assert g.trainable_roles() == {"actor"}
    assert all(m.n_seqs == 32 for m in g.mfcs)  # the group size multiplies


@pytest.mark.parametrize("with_rm", [False, True])
def test_remax_graph(with_rm):
    roles = {"actor", "ref"} | ({"reward"} if with_rm else set())
    g = build_graph("remax", SHAPE, roles)
    m = by_name(g)
    assert m["actor.greedy_generate"].kind == "generate"
    # The greedy rollout is one per prompt; the sampled ones are samples_per_prompt each.
    assert m["actor.greedy_generate"].n_seqs == 8
    assert m["actor.generate"].n_seqs == 32
    e = edges(g)
    if with_rm:
        assert [x.name for x in g.mfcs] == [
            "actor.generate", "actor.greedy_generate", "reward.inference",
            "reward.greedy_inference", "ref.inference", "actor.train"]
        assert m["reward.greedy_inference"].n_seqs == 8
        assert ("actor.greedy_generate", "reward.greedy_inference") in e
        assert ("reward.greedy_inference", "actor.train") in e
        assert ("actor.greedy_generate", "actor.train") not in e
    else:
        assert [x.name for x in g.mfcs] == [
            "actor.generate", "actor.greedy_generate", "ref.inference", "actor.train"]
        assert ("actor.greedy_generate", "actor.train") in e
    assert ("actor.generate", "ref.inference") in e
    assert ("actor.greedy_generate", "ref.inference") not in e
    assert g.dataset_keys() == ["prompts"]


def test_dpo_graph_doubles_the_batch():
    g = build_graph("dpo", SHAPE, {"actor", "ref"})
    assert [(m.name, m.kind) for m in g.mfcs] == [("ref.inference", "inference"),
                                                  ("actor.train", "train")]
    assert edges(g) == {("ref.inference", "actor.train")}
    assert g.dataset_keys() == ["pairs"]
    assert all(m.n_seqs == 16 for m in g.mfcs)  # chosen + rejected per prompt


def test_sft_graph():
    g = build_graph("sft", SHAPE, {"actor"})
    assert [(m.name, m.kind) for m in g.mfcs] == [("actor.train", "train")]
    assert edges(g) == set()
    assert g.dataset_keys() == ["examples"]
    assert g.mfcs[0].n_seqs == 8


def test_rm_graph_doubles_the_batch():
    g = build_graph("rm", SHAPE, {"reward"})
    assert [(m.name, m.role, m.kind) for m in g.mfcs] == [("reward.train", "reward", "train")]
    assert g.dataset_keys() == ["pairs"]
    assert g.mfcs[0].n_seqs == 16
    assert g.trainable_roles() == {"reward"}


@pytest.mark.parametrize("alg,roles,missing", [
    ("ppo", {"actor", "ref", "reward"}, "critic"),
    ("grpo", {"ref"}, "actor"),
    ("dpo", {"actor"}, "ref"),
    ("sft", set(), "actor"),
    ("rm", {"actor"}, "reward"),
])
def test_missing_roles_are_named(alg, roles, missing):
    with pytest.raises(PlanError, match=f"needs the model role\\(s\\) .*{missing}") as e:
        build_graph(alg, SHAPE, roles)
    assert e.value.field == "models"


@pytest.mark.parametrize("alg,roles,extra", [
    ("sft", {"actor", "ref"}, "ref"),
    ("dpo", {"actor", "ref", "reward"}, "reward"),   # DPO never calls a reward model
    ("grpo", {"actor", "ref", "critic"}, "critic"),
    ("rm", {"reward", "actor"}, "actor"),
])
def test_extra_roles_are_rejected(alg, roles, extra):
    with pytest.raises(PlanError, match=f"does not use the model role\\(s\\) {extra}; remove") as e:
        build_graph(alg, SHAPE, roles)
    assert e.value.field == "models"


def test_unknown_algorithm_names_the_field_and_the_choices():
    with pytest.raises(PlanError) as e:
        build_graph("a2c", SHAPE, {"actor"})
    assert e.value.field == "algorithm.name"
    assert "'a2c'" in str(e.value) and "ppo" in str(e.value) and "rloo" in str(e.value)


def call(name: str, ins: tuple[str, ...], outs: tuple[str, ...], kind: str = "inference") -> MFC:
    role = name.split(".")[0]
    return MFC(name=name, role=role, kind=kind, n_seqs=4, prompt_len=8, gen_len=8,
               input_keys=ins, output_keys=outs)


def test_a_hand_built_graph_derives_edges_from_keys():
    g = DataflowGraph(algorithm="custom", mfcs=(
        call("a.x", ("d1",), ("k1",)), call("b.x", ("k1", "d2"), ("k2",)),
        call("c.x", ("k1", "k2", "d1"), ("k3",))))
    assert edges(g) == {("a.x", "b.x"), ("a.x", "c.x"), ("b.x", "c.x")}
    assert g.dataset_keys() == ["d1", "d2"]
    assert g.deps() == [[], [0], [0, 1]]


def test_duplicate_producers_are_rejected():
    with pytest.raises(PlanError, match="'k' is produced by both a.x and b.x") as e:
        DataflowGraph(algorithm="custom", mfcs=(call("a.x", ("d",), ("k",)),
                                                call("b.x", ("d",), ("k",))))
    assert e.value.field == "graph"


def test_duplicate_names_are_rejected():
    with pytest.raises(PlanError, match="duplicate MFC names"):
        DataflowGraph(algorithm="custom", mfcs=(call("a.x", ("d",), ("k1",)),
                                                call("a.x", ("d",), ("k2",))))


def test_cycles_are_rejected():
    with pytest.raises(PlanError, match="cycle") as e:
        DataflowGraph(algorithm="custom", mfcs=(call("a.x", ("k2",), ("k1",)),
                                                call("b.x", ("k1",), ("k2",))))
    assert e.value.field == "graph"


def test_a_call_reading_its_own_output_and_longer_cycles_are_rejected():
    for mfcs in ((call("a.x", ("d", "k1"), ("k1",)),),
                 (call("a.x", ("k3",), ("k1",)), call("b.x", ("k1",), ("k2",)),
                  call("c.x", ("k2",), ("k3",)))):
        with pytest.raises(PlanError, match="has a cycle"):
            DataflowGraph(algorithm="custom", mfcs=mfcs)


def test_edges_are_networkxs():
    for name, spec in ALGORITHMS.items():
        roles = set(spec.required_roles) | set(spec.optional_roles)
        g = build_graph(name, SHAPE, roles - ({"reward"} if name in ("dpo", "sft") else set()))
        nxg = g.to_networkx()
        assert list(nxg.nodes) == [m.name for m in g.mfcs]
        assert {e: nxg.edges[e]["keys"] for e in nxg.edges} == g.edges()
        names = [m.name for m in g.mfcs]
        assert g.deps() == [sorted(names.index(p) for p in nxg.predecessors(n))
                            for n in names]


def test_mfcs_out_of_dataflow_order_are_rejected():
    with pytest.raises(PlanError, match="dataflow order: a.x feeds b.x") as e:
        DataflowGraph(algorithm="custom", mfcs=(call("b.x", ("k1",), ("k2",)),
                                                call("a.x", ("d",), ("k1",))))
    assert e.value.field == "graph"


def test_train_batch_must_split_into_minibatches():
    with pytest.raises(PlanError, match="6 sequences do not split into 4 mini-batches"):
        MFC(name="actor.train", role="actor", kind="train", n_seqs=6, prompt_len=8,
            gen_len=8, input_keys=("d",), output_keys=("s",), n_minibatches=4)
    with pytest.raises(PlanError, match="do not split"):
        build_graph("sft", BatchShape(prompts_per_step=6, ppo_minibatches=4), {"actor"})


# ---- graphs that train on a selection of what they generate -------------------------

def test_rejection_sampling_trains_one_sequence_per_prompt():
    for roles in ({"actor"}, {"actor", "reward"}):
        g = build_graph("rejection_sampling", SHAPE, roles)
        m = by_name(g)
        assert m["actor.generate"].n_seqs == 32                  # 8 prompts x N = 4
        assert m["actor.train"].n_seqs == 8                      # the best of each
        assert m["actor.train"].input_keys == ("seqs", "rewards")
        if "reward" in roles:
            assert m["reward.inference"].n_seqs == 32            # every sample is scored
        else:
            assert [r.out_key for r in g.rule_rewards] == ["rewards"]
    with pytest.raises(PlanError, match="does not use the model role"):
        build_graph("rejection_sampling", SHAPE, {"actor", "ref"})


def test_online_dpo_scores_every_sample_and_trains_pairs():
    g = build_graph("online_dpo", SHAPE, {"actor", "ref", "reward"})
    m = by_name(g)
    assert [x.name for x in g.mfcs] == ["actor.generate", "reward.inference", "ref.inference",
                                        "actor.train"]
    assert m["ref.inference"].n_seqs == m["reward.inference"].n_seqs == 32
    assert (m["actor.train"].n_seqs, m["actor.train"].group_size) == (16, 2)
    with pytest.raises(PlanError, match="ref"):
        build_graph("online_dpo", SHAPE, {"actor"})


def test_dapo_generates_for_more_prompts_than_it_trains():
    shape = SHAPE.model_copy(update={"dropped_group_frac": 0.25})
    assert shape.prompts_generated == 11                         # ceil(8 / 0.75)
    g = build_graph("dapo", shape, {"actor", "ref"})
    m = by_name(g)
    assert m["actor.generate"].n_seqs == m["ref.inference"].n_seqs == 44    # 11 x 4
    assert m["actor.train"].n_seqs == 32                                     # 8 x 4
    # asynchronous: the proximal pass scores every generated sequence
    a = build_graph("dapo", shape, {"actor"}, max_staleness=1, asynchronous=True)
    assert by_name(a)["actor.prox_inference"].n_seqs == 44
    # no share given: no over-generation
    assert by_name(build_graph("dapo", SHAPE, {"actor"}))["actor.generate"].n_seqs == 32


@pytest.mark.parametrize("p,f,n", [(16, 0.0, 16), (16, 0.25, 22), (16, 0.5, 32), (1, 0.95, 20),
                                   (512, 0.1, 569)])
def test_prompts_generated(p, f, n):
    from planner.graph.algorithms import prompts_generated
    assert prompts_generated(p, f) == n


def test_only_dapo_drops_groups_and_selections_do_not_run_ahead():
    shape = SHAPE.model_copy(update={"dropped_group_frac": 0.25})
    with pytest.raises(PlanError, match="only dapo") as e:
        build_graph("grpo", shape, {"actor"})
    assert e.value.field == "algorithm.dropped_group_frac"
    for name, roles in (("rejection_sampling", {"actor"}), ("online_dpo", {"actor", "ref"})):
        with pytest.raises(PlanError, match="max_staleness to 0") as e:
            build_graph(name, SHAPE, roles, max_staleness=1)
        assert e.value.field == "algorithm.max_staleness"


@pytest.mark.parametrize("alg", ["gspo", "dr_grpo"])
def test_gspo_and_dr_grpo_have_grpos_graph(alg):
    for roles in ({"actor"}, {"actor", "ref", "reward"}):
        g, ref = build_graph(alg, SHAPE, roles), build_graph("grpo", SHAPE, roles)
        assert g.mfcs == ref.mfcs
