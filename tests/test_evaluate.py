"""The forced-token evaluation harness (``base_moe.evaluate``) and ``python -m base_moe eval``, on tiny CPU models."""

from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
import subprocess
import warnings
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hf_models import VOCAB, StandInPredictors, tiny_model

import base_moe
from base_moe import hf, reference
from base_moe import evaluate as evaluate_module
from base_moe.evaluate import (
    _energy,
    _Run,
    _time_layers,
    _timing,
    budgets_between,
    dense_union,
    evaluate,
    format_table,
    git_commit,
    json_ready,
    machine_info,
    make_batches,
    plot,
    standard_error,
)
from base_moe.policies import get_policy

B, S, P, N = 4, 12, 3, 2
_MODEL = {}


def model_and_ids():
    if "m" not in _MODEL:
        _MODEL["m"] = tiny_model("qwen3_moe")  # 8 experts, top-2, vocab 64, 2 MoE layers
    g = torch.Generator().manual_seed(0)
    return copy.deepcopy(_MODEL["m"]), torch.randint(3, 64, (N * B * S + 5,), generator=g)


def decode_bits(model, data):
    """Bits per token of the predictions made at decode positions, for the model as it is configured."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in data:
            logits = model(input_ids=ids).logits[:, P:-1]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, P + 1 :].reshape(-1),
                                           reduction="sum"))
            count += ids[:, P + 1 :].numel()
    return total / count / math.log(2)


@pytest.fixture(scope="module")
def result():
    model, ids = model_and_ids()
    return evaluate(model, ids, predictors=StandInPredictors(model), batch=B, seq=S, prefill=P, batches=N,
                    policies=["base", "router_sum", "oracle", "oea", "topk_reduce", "lynx:threshold=2"],
                    budgets=[2, 8], progress=False)


def rows(result, budget):
    return {r["policy"]: r for r in result["results"] if r["budget"] == budget}


# ---------------------------------------------------------------------------------------------
def test_make_batches_and_budgets():
    ids = torch.arange(100)
    data = make_batches(ids, batch=2, seq=5, batches=3)
    assert data.shape == (3, 2, 5) and torch.equal(data.reshape(-1), ids[:30])
    assert torch.equal(make_batches(ids.view(10, 10), 2, 5, 3), data)  # rows are read in order
    with pytest.raises(ValueError, match="enough for 5 batches"):
        make_batches(ids, batch=2, seq=10, batches=6)
    with pytest.raises(ValueError, match="need 30 tokens, the text gives 29"):  # one token short
        make_batches(ids[:29], batch=2, seq=5, batches=3)
    assert budgets_between(20.2) == [7, 8, 9, 10]
    assert budgets_between(12) == [4, 5, 6]
    assert budgets_between(2.5) == [1]
    for union in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive number of experts"):
            budgets_between(union)
    assert json_ready({"a": [1.0, math.nan, {"b": math.inf}], "c": "x"}) == {"a": [1.0, None, {"b": None}], "c": "x"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_make_batches_refuses_ids_that_are_not_integers(dtype):
    """Float ids would be truncated to other tokens without a word."""
    with pytest.raises(TypeError, match=f"integer token ids, got dtype {dtype}"):
        make_batches(torch.full((64,), 1.5).to(dtype), 2, 8, 2)


def test_evaluate_and_dense_union_name_ids_outside_the_vocabulary():
    """An id past the vocabulary (64) or below 0 is refused with the ids' range, not the embedding's bare
    IndexError; ids past the ones used are not looked at."""
    model, ids = model_and_ids()
    used = N * B * S
    for bad in (64, -1):
        wrong = ids.clone()
        wrong[int(torch.randint(0, used, (1,), generator=torch.Generator().manual_seed(bad + 2)))] = bad
        low, high = int(wrong[:used].min()), int(wrong[:used].max())
        message = f"token ids in \\[0, 64\\), got ids from {low} to {high}"
        with pytest.raises(ValueError, match=message):
            evaluate(model, wrong, policies=["router_sum"], budgets=[2], batch=B, seq=S, prefill=P, batches=N)
        with pytest.raises(ValueError, match=message):
            dense_union(model, wrong, batch=B, seq=S, prefill=P, batches=N)
    tail = ids.clone()
    tail[used:] = 1000
    dense_union(model, tail, batch=B, seq=S, prefill=P, batches=N)


def test_one_policy_or_one_budget_is_a_list_of_one():
    """``policies="router_sum"`` is that policy, not its name's letters; ``budgets=2`` is ``[2]``."""
    model, ids = model_and_ids()
    kwargs = dict(batch=2, seq=6, prefill=2, batches=1, progress=False, energy=False)
    one = evaluate(model, ids, policies="router_sum", budgets=2, **kwargs)
    listed = evaluate(model, ids, policies=["router_sum"], budgets=[2], **kwargs)
    assert [(r["policy"], r["budget"]) for r in one["results"]] == [("router_sum", 2)]
    assert one["results"][0]["bits"] == listed["results"][0]["bits"]
    assert evaluate(model, ids, policies=get_policy("oea"), **kwargs)["results"][0]["policy"] == "oea"


def test_budgets_between_is_exact_at_decimal_fractions():
    """Products like 0.7 x 90 round below 63 in binary floating point; the budgets are those of the exact decimal
    fractions."""
    for low, high in (("0.1", "0.3"), ("0.2", "0.7"), ("0.5", "0.7"), ("0.3", "0.6")):
        for union in range(1, 401):
            lo = math.ceil(Fraction(low) * union)
            hi = math.floor(Fraction(high) * union)
            if lo <= hi:
                assert budgets_between(union, float(low), float(high)) == list(range(lo, hi + 1)), (low, high, union)


def test_dense_bits_and_union_match_a_direct_computation(result):
    model, ids = model_and_ids()
    data = make_batches(ids, B, S, N)
    assert result["dense"]["bits"] == pytest.approx(decode_bits(model, data), rel=1e-6)
    assert result["protocol"]["scored_tokens"] == N * B * (S - P - 1)
    assert result["unit"] == "bits/token"  # vocab 64: not byte-level
    # the union: routed experts per layer and position, counted directly
    for layout in base_moe.layouts.find_moe_layouts(model):
        captured = []
        handle = layout.block.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
        with torch.no_grad():
            for batch in data:
                model(input_ids=batch)
        handle.remove()
        sizes = []
        for x in captured:
            for s in range(P, S):
                routed, _ = reference.route(layout.router_logits(x[:, s]), layout.routing)
                sizes.append(len(set(routed.flatten().tolist())))
        assert result["dense"]["union_per_layer"][str(layout.layer_index)] == pytest.approx(sum(sizes) / len(sizes))
    assert result["dense"]["union"] == pytest.approx(dense_union(model, ids, batch=B, seq=S, prefill=P, batches=N))


def test_budgeted_bits_match_the_patched_model(result):
    model, ids = model_and_ids()
    data = make_batches(ids, B, S, N)
    for policy, budget in [("base", 2), ("router_sum", 8), ("oea", None)]:
        m = copy.deepcopy(model)
        base_moe.apply(m, predictors=StandInPredictors(m), policy=policy, budget=budget, group_by="position",
                       dense_positions=P)
        got = rows(result, budget)[policy]
        assert got["bits"] == pytest.approx(decode_bits(m, data), rel=1e-6)
        assert got["delta_bits"] == pytest.approx(got["bits"] - result["dense"]["bits"])


def test_budget_at_least_the_experts_is_dense(result):
    for policy, r in rows(result, 8).items():  # 8 experts: nothing is ever dropped
        assert abs(r["delta_bits"]) < 1e-4, policy
        assert r["retained_energy"] == pytest.approx(1.0)
        assert r["active"] == pytest.approx(result["dense"]["union"])


def test_active_experts_and_energy(result):
    for budget in (2,):
        for policy, r in rows(result, budget).items():
            assert r["active"] <= budget + 1e-9
            assert 0 < r["retained_energy"] < 1
        # layer 0 sees the same inputs under every policy: the oracle keeps the most true energy there
        first = min(rows(result, budget)["oracle"]["retained_energy_per_layer"])
        energy = {p: r["retained_energy_per_layer"][first] for p, r in rows(result, budget).items()}
        assert energy["oracle"] >= max(energy.values()) - 1e-6
    unbudgeted = rows(result, None)
    assert set(unbudgeted) == {"oea", "topk_reduce", "lynx:threshold=2"}
    assert unbudgeted["topk_reduce"]["retained_energy"] < 1


def test_energy_against_a_loop():
    model, _ = model_and_ids()
    layout = base_moe.layouts.find_moe_layouts(model)[0]
    x = torch.randn(10, layout.hidden_size, generator=torch.Generator().manual_seed(2))
    logits = layout.router_logits(x)
    routed, weights = reference.route(logits, layout.routing)
    final = routed.clone()
    final[::2, 1] = layout.num_experts  # every other token lost its second expert
    kept = total = 0.0
    for t in range(10):
        for j in range(layout.routing.top_k):
            u = int(routed[t, j])
            with torch.no_grad():
                e = float(weights[t, j]) ** 2 * float(layout.expert_output(x[t : t + 1], u).pow(2).sum())
            total += e
            kept += e if u in final[t].tolist() else 0.0
    got_kept, got_total = _energy(layout, x, final)
    assert got_total == pytest.approx(total, rel=1e-5) and got_kept == pytest.approx(kept, rel=1e-5)


def test_model_is_left_as_found():
    model, ids = model_and_ids()
    reference_logits = model(input_ids=ids[:S][None]).logits
    evaluate(model, ids, policies=["router_sum"], budgets=[2], batch=B, seq=S, prefill=P, batches=1, progress=False,
             energy=False)
    assert not hf.is_applied(model)
    assert torch.equal(model(input_ids=ids[:S][None]).logits, reference_logits)
    base_moe.apply(model, budget=5, policy="frequency", fill="drop")
    evaluate(model, ids, policies=["oea"], batch=B, seq=S, prefill=P, batches=1, progress=False, energy=False)
    s = hf.moe_layouts(model)[0].block._base_moe.settings
    assert (s.budget, s.policy.name, s.fill.name, s.group_by, s.record) == (5, "frequency", "DROP", "batch", False)
    base_moe.configure(model, policy="oea")  # the budget (5) stays set for a later policy; nobody passes it to oea
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # handing the settings back warns of no budget the user did not give
        evaluate(model, ids, policies=["router_sum"], budgets=[2], batch=B, seq=S, prefill=P, batches=1,
                 progress=False, energy=False)
    assert hf.moe_layouts(model)[0].block._base_moe.settings.policy.name == "oea"


def test_a_model_patched_for_serving_evaluates_as_an_unpatched_one():
    """A model the user patched with finished_tokens='auto' (and the model's own experts and norms) is evaluated with
    apply's defaults, every token of the text voting, even the pad/EOS ids inside it; its settings come back."""
    model, _ = model_and_ids()
    ids = torch.randint(3, 64, (N * B * S,), generator=torch.Generator().manual_seed(1))
    ids[::5] = 2  # the config's EOS inside the text, as between concatenated documents
    predictors = StandInPredictors(model)
    kw = dict(predictors=predictors, policies=["base", "router_sum"], budgets=[2], batch=B, seq=S, prefill=P,
              batches=N, progress=False)
    unpatched = evaluate(copy.deepcopy(model), ids, **kw)
    base_moe.apply(model, predictors=predictors, budget=3, policy="router_sum", finished_tokens="auto",
                   experts="hf", norm="model", record=True)
    before = hf.moe_layouts(model)[0].block._base_moe.settings
    assert before.finished_tokens == (0, 2)
    patched = evaluate(model, ids, **kw)
    assert patched["dense"] == unpatched["dense"]
    assert patched["results"] == unpatched["results"]
    assert hf.moe_layouts(model)[0].block._base_moe.settings == before


def test_result_names_the_predictors_it_ran_with():
    """On a model the user patched without predictors, the result records the ones passed to evaluate (it read them
    after handing the user's settings back, and said None)."""
    model, ids = model_and_ids()
    predictors = StandInPredictors(model)
    predictors.metadata.update(tokens=1234, r2=0.5)
    base_moe.apply(model, policy="router_sum", budget=4)
    result = evaluate(model, ids, predictors=predictors, policies=["base"], budgets=[3], batch=B, seq=S, prefill=P,
                      batches=1, progress=False, energy=False)
    assert result["predictors"] is not None and result["predictors"]["tokens"] == 1234
    assert hf.moe_layouts(model)[0].block._base_moe.predictors is None  # the user's own setting is back


def test_a_sequence_past_the_context_warns():
    model, _ = model_and_ids()  # max_position_embeddings 64
    ids = torch.randint(3, 64, (2 * 66,), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="seq=66 is longer than the model's context \\(max_position_embeddings 64\\)"):
        evaluate(model, ids, policies=["router_sum"], budgets=[2], batch=2, seq=66, prefill=P, batches=1,
                 progress=False, energy=False)


def test_errors():
    model, ids = model_and_ids()
    with pytest.raises(ValueError, match="need budgets"):
        evaluate(model, ids, policies=["router_sum"], budgets=[], batch=B, seq=S, prefill=P, batches=1)
    with pytest.raises(ValueError, match="needs predictors"):
        evaluate(model, ids, policies=["base"], budgets=[2], batch=B, seq=S, prefill=P, batches=1)
    with pytest.raises(ValueError, match="prefill"):
        evaluate(model, ids, policies=["oea"], batch=B, seq=S, prefill=S - 1, batches=1)
    with pytest.raises(ValueError, match="unknown policy"):
        evaluate(model, ids, policies=["nope"], budgets=[2], batch=B, seq=S, prefill=P, batches=1)
    for bad in ([2.9], [True, 2]):
        with pytest.raises(ValueError, match="budgets must be ints"):
            evaluate(model, ids, policies=["router_sum"], budgets=bad, batch=B, seq=S, prefill=P, batches=1)
    with pytest.raises(ValueError, match="k0=3 is more experts per token"):  # before the dense pass
        evaluate(model, ids, policies=["oea:k0=3"], batch=B, seq=S, prefill=P, batches=1)
    with pytest.raises(ValueError, match="timing=True needs a CUDA device"):
        evaluate(model, ids, policies=["router_sum"], budgets=[2], batch=B, seq=S, prefill=P, batches=1,
                 device="cpu", timing=True)
    with pytest.raises(ValueError, match="prefill"):
        dense_union(model, ids, batch=B, seq=S, prefill=S - 1, batches=1)
    assert not hf.is_applied(model)


def test_table_json_and_plot(result, tmp_path):
    table = format_table(result)
    for name in ("dense", "base", "router_sum", "oracle", "oea", "topk_reduce", "lynx:threshold=2"):
        assert name in table
    json.dumps(result)  # JSON-ready
    assert {"torch", "transformers", "platform"} <= set(result["machine"])
    plot(result, str(tmp_path / "q.png"))
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_table_shows_a_missing_standard_error_as_a_dash(result):
    """One batch has no standard error: NaN in the result, null once through JSON; the table prints '-'."""
    single = {**result, "results": [{**r, "delta_bits_stderr": v} for r in result["results"] for v in (math.nan, None)]}
    table = format_table(single)
    assert "nan" not in table.lower()
    base_rows = [line.split() for line in table.splitlines() if line.startswith("base ")]
    assert len(base_rows) == 2 * sum(r["policy"] == "base" for r in result["results"]) > 0
    assert all(fields[5] == "-" for fields in base_rows)  # policy budget active bits +bits +- energy


def test_plot_keeps_a_familys_budgeted_and_unbudgeted_runs_apart(result, tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: labels.append(k.get("label")) or original(self, *a, **k))
    with_budgets = {**result, "results": result["results"] + [{**r, "policy": "lynx", "budget": 3}
                                                              for r in result["results"] if r["policy"] == "base"]}
    plot(with_budgets, str(tmp_path / "q.png"))
    assert "lynx" in labels and "lynx (no budget)" in labels and "oea" in labels


def test_timing_says_which_layers_replayed_a_cuda_graph(monkeypatch):
    """A block that does not capture is timed eagerly: the row says so (time_mode, per layer), not passed off as a
    graph replay. _time_block stands in for the CUDA timing: layer 0 captures, layer 1 does not."""
    model, _ = model_and_ids()
    base_moe.apply(model, policy="router_sum", budget=2, group_by="position", dense_positions=P, record=True)
    layouts = hf.moe_layouts(model)
    graphs = {id(layouts[0].block): True, id(layouts[1].block): False}
    seen = []

    def fake_time_block(block, x, repeats):
        seen.append((tuple(x.shape), block._base_moe.settings.group_by))
        return 10.0 + 5 * len(seen), graphs[id(block)]

    monkeypatch.setattr(evaluate_module, "_time_block", fake_time_block)
    inputs = {lay.layer_index: torch.randn(3 * B, 32) for lay in layouts}
    times, graphed = _time_layers(model, layouts, inputs, B, repeats=5)
    assert seen == [((B, 1, 32), "batch")] * 2 and hf.moe_layouts(model)[0].block._base_moe.settings.group_by == (
        "position")
    i0, i1 = (lay.layer_index for lay in layouts)
    assert times == {i0: 15.0, i1: 20.0} and graphed == {i0: True, i1: False}
    row = _timing(_Run("router_sum", 2, time_us=times, time_graphed=graphed))
    assert row == {"time_us": 17.5, "time_us_per_layer": {str(i0): 15.0, str(i1): 20.0}, "time_mode": "mixed",
                   "time_graphed_per_layer": {str(i0): True, str(i1): False}}
    assert _timing(_Run("x", 2, time_us=times, time_graphed={i0: False, i1: False}))["time_mode"] == "eager"
    assert _timing(_Run("x", 2, time_us=times, time_graphed={i0: True, i1: True}))["time_mode"] == "graph"
    assert _timing(_Run("x", 2))["time_mode"] is None  # not timed


def test_table_and_plot_mark_eager_timings(result, tmp_path, monkeypatch):
    import matplotlib.axes

    modes = {"base": "eager", "router_sum": "mixed"}  # the others (and dense) replayed a graph
    timed = {**result, "dense": {**result["dense"], "time_us": 9.0, "time_mode": "graph"},
             "results": [{**r, "time_us": 11.0 + n, "time_mode": modes.get(r["policy"], "graph")}
                         for n, r in enumerate(result["results"])]}
    lines = format_table(timed).splitlines()
    cells = {}
    for line in lines:
        if line.split() and line.split()[0] in ("dense", "base", "router_sum", "oracle"):
            cells.setdefault(line.split()[0], set()).add(line[-1])
    assert cells == {"dense": {" "}, "base": {"*"}, "router_sum": {"~"}, "oracle": {" "}}  # the mark's column
    assert lines[-1] == ("us/layer: one MoE block per decode batch, CUDA-graph replay; * timed eagerly (the block does "
                         "not capture in a CUDA graph); ~ some layers timed eagerly")
    all_graph = {**timed, "results": [{**r, "time_mode": "graph"} for r in timed["results"]]}
    assert format_table(all_graph).splitlines()[-1] == "us/layer: one MoE block per decode batch, CUDA-graph replay"
    assert "us/layer" not in format_table(result)  # untimed (CPU): no time column, no note

    rings = []
    original = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter",
                        lambda self, x, y, **k: rings.append((k.get("label"), sorted(x))) or original(self, x, y, **k))
    plot(timed, str(tmp_path / "q.png"))
    eager = sorted(r["time_us"] for r in timed["results"] if r["policy"] in modes)
    assert ("timed eagerly (no CUDA graph), all or some layers", eager) in rings
    rings.clear()
    plot(all_graph, str(tmp_path / "q.png"))
    assert [label for label, _ in rings] == ["dense", "dense"]  # no ring where every time is a graph replay


# ---------------------------------------------------------------------------------------------
# python -m base_moe eval
# ---------------------------------------------------------------------------------------------
def test_cli_eval_end_to_end(tmp_path, capsys):
    from test_calibrate import tiny_qwen3_moe

    from base_moe.cli import main

    tiny_qwen3_moe(layers=2).save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 8)
    common = ["--model", str(tmp_path / "model"), "--text", str(text), "--bytes", "--batch", "4", "--seq", "32",
              "--prefill", "8", "--batches", "2", "--device", "cpu", "--no-progress"]
    assert main(["calibrate", *common[:5], "--tokens", "2048", "--seq", "32", "--device", "cpu", "--out",
                 str(tmp_path / "p.safetensors"), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "r.json"
    assert main(["eval", *common, "--predictors", str(tmp_path / "p.safetensors"), "--policies",
                 "base,static_energy,router_sq,oea:k0=1,topk_reduce:k=1", "--json", str(out),
                 "--plot", str(tmp_path / "r.png")]) == 0
    printed = capsys.readouterr().out
    assert "dense union" in printed and "bits/byte" in printed and f"wrote {out}" in printed
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m base_moe eval --model")
    assert result["unit"] == "bits/byte" and result["protocol"]["batch"] == 4
    budgets = {r["budget"] for r in result["results"]} - {None}
    assert budgets and all(result["dense"]["union"] / 3 - 1 <= b <= result["dense"]["union"] / 2 + 1
                           for b in budgets)
    assert (tmp_path / "r.png").exists()
    with pytest.raises(SystemExit, match="need --predictors"):
        main(["eval", *common, "--policies", "base", "--budgets", "2", "--json", str(out)])
    with pytest.raises(SystemExit, match="unknown policy"):
        main(["eval", *common, "--policies", "bogus", "--budgets", "2", "--json", str(out)])


@pytest.mark.cuda
def test_cuda_timing():
    model, ids = model_and_ids()
    model = model.cuda()
    r = evaluate(model, ids, policies=["router_sum"], budgets=[2], batch=B, seq=S, prefill=P, batches=1,
                 progress=False, repeats=5)
    assert r["dense"]["time_us"] > 0 and r["results"][0]["time_us"] > 0
    assert set(r["results"][0]["time_us_per_layer"]) == {str(i) for i in r["model"]["moe_layers"]}
    for row in (r["dense"], r["results"][0]):
        assert row["time_mode"] in ("graph", "eager", "mixed")
        assert set(row["time_graphed_per_layer"]) == {str(i) for i in r["model"]["moe_layers"]}


def test_git_commit_names_the_measured_tree(monkeypatch):
    """Result files name $BASE_MOE_COMMIT where set (a copy of the tree on a lent GPU machine, whose .git does not
    follow the commits), else the source tree's HEAD."""
    monkeypatch.setenv("BASE_MOE_COMMIT", "abc123 + notes/some.patch")
    assert machine_info()["git_commit"] == "abc123 + notes/some.patch"
    monkeypatch.delenv("BASE_MOE_COMMIT")
    head = machine_info()["git_commit"]
    assert head is None or (len(head) == 40 and all(c in "0123456789abcdef" for c in head))


def test_git_commit_ignores_a_repository_around_an_installed_copy(tmp_path, monkeypatch):
    """Installed in a project's .venv, the package is inside the project's repository, whose HEAD is not base_moe's."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.delenv("BASE_MOE_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "--allow-empty", "-m", "project"], check=True)
    site = tmp_path / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    assert git_commit(str(site)) is None
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert git_commit(str(tmp_path)) == head.strip()


# ---------------------------------------------------------------------------------------------
# Edge cases found by mutation testing
# ---------------------------------------------------------------------------------------------
def test_standard_error_of_the_per_batch_increase(result):
    for r in result["results"]:
        deltas = [b - d for b, d in zip(r["bits_per_batch"], result["dense"]["bits_per_batch"])]
        assert len(deltas) == N
        assert r["delta_bits_stderr"] == pytest.approx(statistics.stdev(deltas) / math.sqrt(N), rel=1e-9, abs=1e-15)


def test_a_byte_level_model_reports_bits_per_byte():
    model = tiny_model("qwen3_moe", vocab_size=256)
    ids = torch.randint(3, 256, (2 * 6,), generator=torch.Generator().manual_seed(2))
    kwargs = dict(policies=["oea"], batch=2, seq=6, prefill=2, batches=1, progress=False, energy=False)
    result = evaluate(model, ids, **kwargs)
    assert result["unit"] == "bits/byte" and result["model"]["vocab_size"] == 256
    assert evaluate(model, ids, byte_level=False, **kwargs)["unit"] == "bits/token"


def test_standard_error_of_random_values():
    values = torch.randn(7, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    expected = torch.tensor(values, dtype=torch.float64).std(unbiased=True).item() / math.sqrt(7)
    assert standard_error(values) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(standard_error(values[:1])) and math.isnan(standard_error([]))


def test_the_report_gives_expert_counts_per_layer_where_layers_differ():
    """A model whose layer 0 is dense and whose MoE layers 1-3 have 8, 4 and 8 experts, top-k k, 1 and k: the
    report's model section says so per layer, by layer index (it gave the first MoE layer's numbers for the whole
    model); a model whose layers agree keeps one number."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    model = tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0])
    fewer = copy.deepcopy(model.config)
    fewer.num_experts, fewer.num_experts_per_tok = 4, 1
    torch.manual_seed(5)
    model.model.layers[2].mlp = Qwen3MoeSparseMoeBlock(fewer)
    for p in model.model.layers[2].mlp.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    ids = torch.randint(3, VOCAB, (2 * 6,), generator=torch.Generator().manual_seed(2))
    kwargs = dict(policies=["oea"], batch=2, seq=6, prefill=2, batches=1, progress=False, energy=False)
    report = evaluate(model, ids, **kwargs)["model"]
    k = model.config.num_experts_per_tok
    assert report["num_experts"] == {1: 8, 2: 4, 3: 8} and report["top_k"] == {1: k, 2: 1, 3: k}
    assert evaluate(tiny_model("qwen3_moe"), ids, **kwargs)["model"]["num_experts"] == 8


def test_a_sequence_as_long_as_the_context_does_not_warn():
    model, _ = model_and_ids()  # max_position_embeddings 64
    ids = torch.randint(3, 64, (64,), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(model, ids, policies=["oea"], batch=1, seq=64, prefill=P, batches=1, progress=False, energy=False)


def test_a_policy_named_twice_runs_once():
    model, ids = model_and_ids()
    result = evaluate(model, ids, policies=["router_sum", "oea", get_policy("router_sum"), "oea"], budgets=[2, 2],
                      batch=2, seq=6, prefill=2, batches=1, progress=False, energy=False)
    assert sorted((r["policy"], r["budget"] or 0) for r in result["results"]) == [("oea", 0), ("router_sum", 2)]
    # specs with options build a new policy object each time: still one run per name
    specs = ["oea:k0=2", "oea:k0=2", "lynx:threshold=2", "lynx:threshold=2"]
    result = evaluate(model, ids, policies=specs, batch=2, seq=6, prefill=2, batches=1, progress=False, energy=False)
    assert sorted(r["policy"] for r in result["results"]) == ["lynx:threshold=2", "oea:k0=2"]


def test_substitute_needs_similarity_only_where_a_policy_takes_the_fill():
    """fill='substitute' with predictors without similarity: a clear error when a policy of the run takes the fill,
    none when only per-token top-k reduction runs (it ignores every fill); the model is handed back unpatched."""
    model, ids = model_and_ids()
    kwargs = dict(batch=B, seq=S, prefill=P, batches=1, fill="substitute", progress=False, energy=False)
    with pytest.raises(ValueError, match="fill='substitute' needs predictors calibrated with similarity=True"):
        evaluate(model, ids, predictors=StandInPredictors(model), policies=["router_sum"], budgets=[2], **kwargs)
    assert not hf.is_applied(model)
    out = evaluate(model, ids, predictors=StandInPredictors(model), policies=["topk_reduce"], **kwargs)
    assert out["protocol"]["fill"] == "substitute" and [r["policy"] for r in out["results"]] == ["topk_reduce"]
    with_similarity = StandInPredictors(model, with_similarity=True)
    out = evaluate(model, ids, predictors=with_similarity, policies=["router_sum"], budgets=[2], **kwargs)
    assert math.isfinite(out["results"][0]["delta_bits"])
