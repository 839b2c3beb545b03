// Python bindings of the search core: module planner._core.
//
// planner/search/core_bridge.py packs a planner.search.problem.Problem into a _core.Problem and
// wraps simulate / anneal; use it rather than this module directly.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "search_core.hpp"

namespace py = pybind11;
using namespace realign_core;

namespace {

using IntLists = std::vector<std::vector<i64>>;
using FloatLists = std::vector<std::vector<double>>;
using PlaceTuple = std::vector<i64>;           // (first_gpu, n_gpus, tp, pp, dp[, ep])
// planner.cost.realloc_cost.ReallocModel's fields: its ten numbers (n_layers ..
// layer_expert_bytes, dense_layer_sharded_bytes, dense_layer_replicated_bytes), then
// its dense_layers
using ReallocModelTuple = std::vector<i64>;

Place place_of(const PlaceTuple& t) {
    if (t.size() != 5 && t.size() != 6)
        throw std::invalid_argument("src/dst: need (first_gpu, n_gpus, tp, pp, dp[, ep])");
    return Place{t[0], t[1], t[2], t[3], t[4], t.size() == 6 ? t[5] : 1};
}

ReallocModel realloc_model_of(const ReallocModelTuple& t) {
    if (t.size() < 10)
        throw std::invalid_argument("realloc_models: need ten numbers, then the dense layers");
    ReallocModel m;
    m.n_layers = t[0];
    m.layer_sharded_bytes = t[1];
    m.layer_replicated_bytes = t[2];
    m.embedding_bytes = t[3];
    m.final_norm_bytes = t[4];
    m.head_kind = static_cast<int>(t[5]);
    m.head_bytes = t[6];
    m.layer_expert_bytes = t[7];
    m.dense_layer_sharded_bytes = t[8];
    m.dense_layer_replicated_bytes = t[9];
    m.dense_layers.assign(t.begin() + 10, t.end());
    return m;
}

template <class T>
void check_shape(const std::vector<std::vector<T>>& a, const IntLists& like, const char* name) {
    if (a.size() != like.size())
        throw std::invalid_argument(std::string(name) + ": needs one list per MFC");
    for (size_t i = 0; i < a.size(); ++i)
        if (a[i].size() != like[i].size())
            throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) +
                                        "]: needs one value per candidate, like cand_first_gpu");
}

// Builds and validates a Problem from plain arrays (one list per MFC for the
// candidate fields). planner.search.core_bridge.to_core is the caller.
Problem make_problem(i64 n_gpus, double mem_limit_bytes, i64 n_iters, i64 gpus_per_node,
                     double intra_bytes_per_s, double inter_bytes_per_s, double intra_latency_s,
                     double inter_latency_s, const std::vector<i64>& mfc_model,
                     const std::vector<bool>& mfc_is_train, const IntLists& deps,
                     const std::vector<i64>& model_train_mfc,
                     const std::vector<ReallocModelTuple>& realloc_models,
                     const IntLists& cand_first_gpu, const IntLists& cand_n_gpus,
                     const IntLists& cand_tp, const IntLists& cand_pp, const IntLists& cand_dp,
                     const IntLists& cand_ep,
                     const FloatLists& cand_time_s, const FloatLists& cand_resident_bytes,
                     const FloatLists& cand_activation_bytes, const FloatLists& cand_weights_bytes,
                     const std::vector<IntLists>& mesh_groups, const IntLists& mesh_of,
                     double realloc_fixed_s,
                     double copy_bytes_per_s,
                     const std::vector<std::vector<std::array<i64, 2>>>& inputs,
                     const IntLists& outputs, const std::vector<i64>& mfc_every,
                     const std::vector<bool>& ahead,
                     const std::vector<double>& key_send_intra_s,
                     const std::vector<double>& key_send_inter_s,
                     double step_overhead_s, const FloatLists& cand_time_sd_s,
                     const std::vector<bool>& model_lora,
                     const std::vector<bool>& mfc_base) {
    check_shape(cand_n_gpus, cand_first_gpu, "cand_n_gpus");
    check_shape(cand_tp, cand_first_gpu, "cand_tp");
    check_shape(cand_pp, cand_first_gpu, "cand_pp");
    check_shape(cand_dp, cand_first_gpu, "cand_dp");
    check_shape(cand_ep, cand_first_gpu, "cand_ep");
    check_shape(cand_time_s, cand_first_gpu, "cand_time_s");
    check_shape(cand_time_sd_s, cand_first_gpu, "cand_time_sd_s");
    check_shape(cand_resident_bytes, cand_first_gpu, "cand_resident_bytes");
    check_shape(cand_activation_bytes, cand_first_gpu, "cand_activation_bytes");
    check_shape(cand_weights_bytes, cand_first_gpu, "cand_weights_bytes");
    Problem p;
    p.n_gpus = n_gpus;
    p.mem_limit_bytes = mem_limit_bytes;
    p.n_iters = n_iters;
    p.step_overhead_s = step_overhead_s;
    p.links = Links{gpus_per_node, intra_bytes_per_s, inter_bytes_per_s, intra_latency_s,
                    inter_latency_s, realloc_fixed_s, copy_bytes_per_s};
    p.inputs = inputs;
    p.outputs = outputs;
    p.mfc_every = mfc_every;
    p.ahead = ahead;
    p.key_send_intra_s = key_send_intra_s;
    p.key_send_inter_s = key_send_inter_s;
    p.mfc_model = mfc_model;
    p.mfc_is_train = mfc_is_train;
    p.deps = deps;
    p.model_train_mfc = model_train_mfc;
    p.model_lora = model_lora;
    if (p.model_lora.empty()) p.model_lora.assign(model_train_mfc.size(), false);
    if (p.model_lora.size() != model_train_mfc.size())
        throw std::invalid_argument("model_lora: needs one entry per model, like model_train_mfc");
    p.mfc_base = mfc_base;
    if (p.mfc_base.empty()) p.mfc_base.assign(mfc_model.size(), false);
    if (p.mfc_base.size() != mfc_model.size())
        throw std::invalid_argument("mfc_base: needs one entry per MFC, like mfc_model");
    for (const auto& t : realloc_models) p.realloc_models.push_back(realloc_model_of(t));
    p.cands.resize(cand_first_gpu.size());
    for (size_t i = 0; i < cand_first_gpu.size(); ++i) {
        for (size_t j = 0; j < cand_first_gpu[i].size(); ++j) {
            Candidate c;
            c.place = Place{cand_first_gpu[i][j], cand_n_gpus[i][j], cand_tp[i][j], cand_pp[i][j],
                            cand_dp[i][j], cand_ep[i][j]};
            c.time_s = cand_time_s[i][j];
            c.time_sd_s = cand_time_sd_s[i][j];
            c.resident_bytes = cand_resident_bytes[i][j];
            c.activation_bytes = cand_activation_bytes[i][j];
            c.weights_bytes = cand_weights_bytes[i][j];
            p.cands[i].push_back(c);
        }
    }
    p.mesh_groups = mesh_groups;
    p.mesh_of = mesh_of;
    p.validate();
    p.index_places();
    return p;
}

// _core.simulate: planner.search.simulator.simulate + memory, with a fresh cache.
std::tuple<double, double, double, std::vector<double>> py_simulate(
    const Problem& prob, const std::vector<i64>& assign) {
    check_assign(prob, assign, "assign");
    ReallocCache cache(prob);
    SimResult r = simulate(prob, assign, cache);
    return {r.iter_time_s, r.makespan_s, r.overflow_bytes, std::move(r.peak_bytes)};
}

// _core.realloc_time: planner.cost.realloc_cost.realloc_time with the problem's links.
std::tuple<double, i64> py_realloc_time(const Problem& prob, i64 model, const PlaceTuple& src,
                                        const PlaceTuple& dst) {
    if (model < 0 || model >= static_cast<i64>(prob.realloc_models.size()))
        throw std::invalid_argument("model: " + std::to_string(model) + " is not a model index");
    for (const PlaceTuple* t : {&src, &dst}) {
        const Place p = place_of(*t);
        if (p.first_gpu < 0 || p.n_gpus < 1 || p.tp < 1 || p.pp < 1 || p.dp < 1 ||
            p.tp * p.pp * p.dp != p.n_gpus || p.ep < 1 || p.dp % p.ep != 0)
            throw std::invalid_argument(
                "src/dst: need first_gpu >= 0 and tp, pp, dp >= 1 with tp * pp * dp == n_gpus, "
                "ep >= 1 dividing dp");
    }
    const ReallocCost c =
        realloc_time(prob.realloc_models[model], place_of(src), place_of(dst), prob.links);
    return {c.time_s, c.bytes};
}

// _core.anneal / Simulator.anneal: planner.search.anneal.anneal; the GIL is released
// during the walk. `cache`: the simulator's (null: a fresh one).
std::tuple<std::vector<i64>, double, bool, i64, i64> anneal_with(
    const Problem& prob, ReallocCache* cache, const std::vector<i64>& start, i64 n_steps,
    double t0_frac, double t1_frac, i64 restart_every, u64 seed, double time_limit_s,
    i64 patience) {
    check_assign(prob, start, "start");
    if (n_steps < 0) throw std::invalid_argument("n_steps: must be >= 0");
    if (!(t0_frac > 0.0) || !(t1_frac > 0.0))
        throw std::invalid_argument("t0_frac, t1_frac: must be > 0");
    if (restart_every < 0) throw std::invalid_argument("restart_every: must be >= 0");
    if (patience < 0) throw std::invalid_argument("patience: must be >= 0");
    AnnealSettings s{n_steps, t0_frac, t1_frac, restart_every, seed, patience};
    AnnealResult r;
    {
        py::gil_scoped_release release;
        r = anneal(prob, start, s, time_limit_s, cache);
    }
    return {std::move(r.assign), r.energy, r.feasible, r.steps, r.accepted};
}

std::tuple<std::vector<i64>, double, bool, i64, i64> py_anneal(
    const Problem& prob, const std::vector<i64>& start, i64 n_steps, double t0_frac,
    double t1_frac, i64 restart_every, u64 seed, double time_limit_s, i64 patience) {
    return anneal_with(prob, nullptr, start, n_steps, t0_frac, t1_frac, restart_every, seed,
                       time_limit_s, patience);
}

std::tuple<double, double, double, std::vector<double>> sim_simulate(
    Simulator& sim, const std::vector<i64>& assign) {
    check_assign(sim.prob, assign, "assign");
    SimResult r = simulate(sim.prob, assign, sim.cache);
    return {r.iter_time_s, r.makespan_s, r.overflow_bytes, std::move(r.peak_bytes)};
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "realign's C++ search core: the twin of planner.search.simulator, "
              "planner.cost.realloc_cost and planner.search.anneal (bit-identical results).";

    py::class_<Problem>(m, "Problem",
                        "The search problem in numbers (see planner.search.core_bridge.to_core).")
        .def(py::init(&make_problem), py::arg("n_gpus"), py::arg("mem_limit_bytes"),
             py::arg("n_iters"), py::arg("gpus_per_node"), py::arg("intra_bytes_per_s"),
             py::arg("inter_bytes_per_s"), py::arg("intra_latency_s"),
             py::arg("inter_latency_s"), py::arg("mfc_model"), py::arg("mfc_is_train"),
             py::arg("deps"), py::arg("model_train_mfc"), py::arg("realloc_models"),
             py::arg("cand_first_gpu"), py::arg("cand_n_gpus"), py::arg("cand_tp"),
             py::arg("cand_pp"), py::arg("cand_dp"), py::arg("cand_ep"), py::arg("cand_time_s"),
             py::arg("cand_resident_bytes"), py::arg("cand_activation_bytes"),
             py::arg("cand_weights_bytes"), py::arg("mesh_groups"), py::arg("mesh_of"),
             py::arg("realloc_fixed_s"),
             py::arg("copy_bytes_per_s"), py::arg("inputs"), py::arg("outputs"),
             py::arg("mfc_every"), py::arg("ahead"), py::arg("key_send_intra_s"), py::arg("key_send_inter_s"),
             py::arg("step_overhead_s"), py::arg("cand_time_sd_s"),
             py::arg("model_lora") = std::vector<bool>{},
             py::arg("mfc_base") = std::vector<bool>{})
        .def_property_readonly("n_gpus", [](const Problem& p) { return p.n_gpus; })
        .def_property_readonly("n_mfcs", &Problem::n_mfcs)
        .def_property_readonly("n_cands", [](const Problem& p) {
            std::vector<i64> n;
            for (const auto& c : p.cands) n.push_back(static_cast<i64>(c.size()));
            return n;
        });

    m.def("simulate", &py_simulate, py::arg("problem"), py::arg("assign"),
          "planner.search.simulator.simulate + memory: "
          "(iter_time_s, makespan_s, overflow_bytes, peak_bytes).");
    m.def("realloc_time", &py_realloc_time, py::arg("problem"), py::arg("model"),
          py::arg("src"), py::arg("dst"),
          "planner.cost.realloc_cost.realloc_time of model index `model` from place `src` to "
          "`dst` ((first_gpu, n_gpus, tp, pp, dp)) with the problem's links: "
          "(seconds, bytes).");
    m.def("anneal", &py_anneal, py::arg("problem"), py::arg("start"), py::arg("n_steps"),
          py::arg("t0_frac"), py::arg("t1_frac"), py::arg("restart_every"), py::arg("seed"),
          py::arg("time_limit_s") = 0.0, py::arg("patience") = 0,
          "planner.search.anneal.anneal: (assign, energy, feasible, steps_done, accepted). "
          "time_limit_s <= 0: no limit; patience > 0: stop after that many steps without "
          "a better plan.");

    py::class_<Simulator>(m, "Simulator",
                          "A problem's simulator whose reallocation cache lasts across calls.")
        .def(py::init<const Problem&>(), py::arg("problem"), py::keep_alive<1, 2>())
        .def("simulate", &sim_simulate, py::arg("assign"),
             "as _core.simulate, with the cache: (iter_time_s, makespan_s, overflow_bytes, "
             "peak_bytes).")
        .def("anneal",
             [](Simulator& sim, const std::vector<i64>& start, i64 n_steps, double t0_frac,
                double t1_frac, i64 restart_every, u64 seed, double time_limit_s,
                i64 patience) {
                 return anneal_with(sim.prob, &sim.cache, start, n_steps, t0_frac, t1_frac,
                                    restart_every, seed, time_limit_s, patience);
             },
             py::arg("start"), py::arg("n_steps"), py::arg("t0_frac"), py::arg("t1_frac"),
             py::arg("restart_every"), py::arg("seed"), py::arg("time_limit_s") = 0.0,
             py::arg("patience") = 0, "as _core.anneal, with the cache.");
}
