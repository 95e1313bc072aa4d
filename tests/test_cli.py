"""``python -m base_moe calibrate`` end to end on a tiny byte-level Qwen3-MoE checkpoint directory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import base_moe
from base_moe import Predictors
from base_moe.cli import build_parser, check_byte_vocabulary, load_token_ids, main

TEXT = (
    "The quick brown fox jumps over the lazy dog. Batched decoding streams every active expert's weights once; "
    "an expert budget keeps the experts whose removal would cost the most. "
) * 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A randomly initialised byte-level (vocab 256) Qwen3-MoE saved with save_pretrained, and a text file."""
    from test_calibrate import tiny_qwen3_moe

    root = tmp_path_factory.mktemp("ckpt")
    tiny_qwen3_moe(layers=2).save_pretrained(root / "model")
    (root / "text.txt").write_text(TEXT)
    return root


def calibrate_args(root, out, *extra):
    return [
        "calibrate", "--model", str(root / "model"), "--text", str(root / "text.txt"), "--tokens", "1024",
        "--seq", "64", "--bytes", "--device", "cpu", "--out", str(out), "--no-progress", *extra,
    ]


def test_cli_calibrate_end_to_end(checkpoint, tmp_path, capsys):
    out = tmp_path / "pred.safetensors"
    assert main(calibrate_args(checkpoint, out, "--batch-size", "4")) == 0
    printed = capsys.readouterr().out
    assert "R^2" in printed and "mean log||E||" in printed and "tokens train/held" in printed
    rows = [row for row in map(str.split, printed.splitlines()) if len(row) == 6 and row[0].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"]  # one row per MoE layer
    assert all(row[-1] == "960/64" for row in rows)  # 16 sequences of 64, the 10th held out
    assert "tokens (64 held out)" in printed and "peak host RSS" in printed and f"wrote {out}" in printed

    predictors = Predictors.load(out)
    assert predictors.layers == [0, 1] and all(math.isfinite(v) for v in predictors.r2.values())
    meta = predictors.metadata
    assert (meta["tokens"], meta["sequences"], meta["seq_len"], meta["model_type"]) == (1024, 16, 64, "qwen3_moe")
    assert meta["model_name_or_path"] == str(checkpoint / "model")

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model", local_files_only=True)
    predictors.check_compatible(model)
    base_moe.apply(model, predictors=str(out), budget=2)  # the file is what apply() takes
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (4, 8)))

    # same model, text and options: the same file, byte for byte
    again = tmp_path / "again.safetensors"
    assert main(calibrate_args(checkpoint, again, "--batch-size", "4")) == 0
    assert out.read_bytes() == again.read_bytes()


def test_similarity_and_the_substitute_fill(checkpoint, tmp_path):
    """calibrate --similarity stores every layer's expert similarity; eval --fill substitute runs with it and is a
    clear error without it."""
    with_sim, plain = tmp_path / "s.safetensors", tmp_path / "p.safetensors"
    assert main(calibrate_args(checkpoint, with_sim, "--similarity")) == 0
    assert main(calibrate_args(checkpoint, plain)) == 0
    assert sorted(Predictors.load(with_sim).similarity) == [0, 1] and Predictors.load(plain).similarity == {}
    argv = ["eval", "--model", str(checkpoint / "model"), "--text", str(checkpoint / "text.txt"), "--bytes",
            "--device", "cpu", "--policies", "base", "--budgets", "2", "--batch", "4", "--seq", "16", "--prefill", "4",
            "--batches", "1", "--fill", "substitute", "--no-progress", "--json", str(tmp_path / "o.json")]
    assert main([*argv, "--predictors", str(with_sim)]) == 0
    with open(tmp_path / "o.json") as f:
        assert json.load(f)["protocol"]["fill"] == "substitute"
    with pytest.raises(SystemExit, match="--fill substitute needs predictors calibrated with --similarity; .* holds "
                       "the expert similarity of 0 of its 2 MoE layers"):
        main([*argv, "--predictors", str(plain)])


def test_eval_checks_the_predictors_against_the_model_before_the_dense_pass(checkpoint, tmp_path, no_dense_pass):
    """Predictors of another model (here one of its two MoE layers) stop eval before the dense-union pass, and eval
    uses the file it read."""
    E, H = 8, 32
    one_layer = Predictors({0: torch.zeros(E, H)}, {0: torch.zeros(E)}, {0: torch.zeros(E)})
    path = tmp_path / "one.safetensors"
    one_layer.save(path)
    with pytest.raises(SystemExit, match="predictors do not match this model"):
        main(eval_args(checkpoint, tmp_path, "--policies", "base", "--predictors", str(path)))


def eval_args(root, tmp_path, *extra):
    return ["eval", "--model", str(root / "model"), "--text", str(root / "text.txt"), "--bytes", "--device", "cpu",
            "--batch", "4", "--seq", "16", "--prefill", "4", "--batches", "1", "--no-progress",
            "--json", str(tmp_path / "o.json"), *extra]


@pytest.fixture
def no_dense_pass(monkeypatch):
    """The dense-union pass fails the test if eval runs it."""
    def dense_pass(*args, **kwargs):
        raise AssertionError("the dense-union pass ran")

    monkeypatch.setattr("base_moe.evaluate.dense_union", dense_pass)


def test_eval_checks_policy_options_before_the_dense_pass(checkpoint, tmp_path, no_dense_pass):
    """An option the model's routing cannot take (OEA's k0 past its top-2) stops eval before the dense-union pass."""
    with pytest.raises(SystemExit, match="k0"):
        main(eval_args(checkpoint, tmp_path, "--policies", "router_sq,oea:k0=3"))


def test_eval_without_budgeted_policies_skips_the_dense_pass(checkpoint, tmp_path, no_dense_pass, capsys):
    """OEA chooses its own expert count: no budget to derive, so no dense-union pass, and the table has its row."""
    assert main(eval_args(checkpoint, tmp_path, "--policies", "oea:k0=1")) == 0
    with open(tmp_path / "o.json") as f:
        assert [r["policy"] for r in json.load(f)["results"]] == ["oea"]
    assert "dense union" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "policies, needing",
    [("router_sq,static_energy", "static_energy"), ("static_energy,base,router_sum", "static_energy, base")],
)
def test_eval_policies_needing_statistics_want_predictors_first(tmp_path, policies, needing):
    """static_energy needs the calibrated mean log-norms (``needs_statistics``), which only a predictors file holds:
    without --predictors eval stops first, naming it among the policies that need the file, before any path check
    (the model folder here does not exist); policies needing neither pass the check and reach the path checks."""
    argv = ["eval", "--model", str(tmp_path / "none"), "--text", str(tmp_path / "t.txt"), "--device", "cpu",
            "--json", str(tmp_path / "o.json"), "--policies"]
    with pytest.raises(SystemExit, match=f"^error: policies {needing} need --predictors FILE"):
        main([*argv, policies])
    with pytest.raises(SystemExit, match="--model .* is not a directory"):
        main([*argv, "router_sq,router_sum"])


@pytest.mark.parametrize("command", ["calibrate", "eval"])
def test_commands_without_transformers_say_so_first(tmp_path, monkeypatch, command):
    """transformers is an extra: without it, the commands stop at once with an install hint, not at the model load."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = [command, "--model", str(tmp_path / "none"), "--text", str(text), "--device", "cpu",
            *(["--out", str(tmp_path / "p")] if command == "calibrate" else ["--json", str(tmp_path / "o.json")])]
    with pytest.raises(SystemExit, match="needs transformers"):
        main(argv)


def test_python_dash_m(checkpoint, tmp_path):
    out = tmp_path / "pred.safetensors"
    cmd = [sys.executable, "-m", "base_moe", *calibrate_args(checkpoint, out, "--tokens", "256", "--seq", "32", "--ridge-sweep", "0.01,1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout and Predictors.load(out).metadata["tokens"] == 256
    assert "(used)" in result.stdout and "mean R^2" in result.stdout  # the ridge sweep table


def test_tokenizer_path(checkpoint, tmp_path):
    """Without --bytes the model directory's tokenizer encodes the text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(TEXT.split()))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokdir = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tokdir)
    ids = load_token_ids(str(checkpoint / "text.txt"), str(tokdir), tokens=40, seq=16, byte_level=False)
    expected = [1 + words.index(w) for w in TEXT.split()[:32]]
    assert ids.shape == (2, 16) and ids.flatten().tolist() == expected

    with pytest.raises(SystemExit, match="no tokenizer.*--bytes"):
        load_token_ids(str(checkpoint / "text.txt"), str(checkpoint / "model"), tokens=40, seq=16, byte_level=False)


def test_bytes_and_argument_errors(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(200)))
    ids = load_token_ids(str(text), "unused", tokens=150, seq=64, byte_level=True)
    assert ids.dtype == torch.int64 and ids.shape == (2, 64) and ids.flatten().tolist() == list(range(128))
    for too_few in (64, 255):
        with pytest.raises(SystemExit, match="at least 256"):
            check_byte_vocabulary(too_few)
    check_byte_vocabulary(256)
    with pytest.raises(SystemExit, match="fewer than one sequence"):
        load_token_ids(str(text), "unused", tokens=512, seq=256, byte_level=True)
    with pytest.raises(SystemExit, match="not a directory"):
        main(["calibrate", "--model", str(tmp_path / "nope"), "--text", str(text), "--out", "x", "--bytes"])
    with pytest.raises(SystemExit):  # argparse: --out is required
        build_parser().parse_args(["calibrate", "--model", "m", "--text", "t"])
    args = build_parser().parse_args(["calibrate", "--model", "m", "--text", "t", "--out", "o"])
    assert (args.tokens, args.seq, args.batch_size, args.ridge, args.holdout, args.bytes) == (
        65536, None, 8, 1e-3, 0.1, False)  # --seq: the model's context decides (resolve_seq)


def test_seq_follows_the_models_context(tmp_path):
    """calibrate's default sequence is 512 tokens or the model's context if shorter; a longer --seq is refused (its
    positions past the context are off the model's distribution)."""
    from base_moe.cli import resolve_seq

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 256}')
    assert resolve_seq(None, str(tmp_path), 512) == 256 and resolve_seq(128, str(tmp_path), 512) == 128
    with pytest.raises(SystemExit, match="--seq 300 is longer than the model's context"):
        resolve_seq(300, str(tmp_path), 512)
    (tmp_path / "config.json").write_text('{"text_config": {"max_position_embeddings": 4096}}')
    assert resolve_seq(None, str(tmp_path), 512) == 512
    (tmp_path / "config.json").write_text("{}")
    assert resolve_seq(None, str(tmp_path), 512) == 512 and resolve_seq(9000, str(tmp_path), 512) == 9000
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    assert resolve_seq(64, str(tmp_path), 512) == 64  # as long as the context: taken
    with pytest.raises(SystemExit, match="--seq 65 is longer than the model's context"):
        resolve_seq(65, str(tmp_path), 512)
    # a context that is no length (0, negative) says nothing: the text model's, if any, is used
    config = '{"max_position_embeddings": 0, "text_config": {"max_position_embeddings": 64}}'
    (tmp_path / "config.json").write_text(config)
    assert resolve_seq(None, str(tmp_path), 512) == 64
    (tmp_path / "config.json").write_text('{"max_position_embeddings": -1}')
    assert resolve_seq(None, str(tmp_path), 512) == 512


def empty_checkpoint(folder, config="{}"):
    """A folder that passes the CLI's early check (it has a config.json) but would fail to load as a model."""
    folder.mkdir()
    (folder / "config.json").write_text(config)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--holdout", "1.5"], "--holdout: expected a number >= 0.0 and < 1.0"),
        (["--batch-size", "0"], "--batch-size: expected an integer >= 1"),
        (["--ridge", "-1"], "--ridge: expected a number >= 0.0"),
        (["--ridge-sweep", "0.1,x"], "--ridge-sweep: expected a number, got 'x'"),
        (["--ridge-sweep", ","], "--ridge-sweep: expected one or more comma-separated values, got ','"),  # meant none
        (["--ridge", "nan"], "--ridge: expected a number >= 0.0, got nan"),
        (["--batch-size", "-1" + "0" * 400], "--batch-size: expected an integer >= 1"),  # no OverflowError
        (["--holdout", "inf"], "--holdout: expected a number >= 0.0 and < 1.0, got inf"),
        (["--holdout", "0.00001"], "--holdout: holdout must be 0 or strictly between 1/20000"),  # rounds to 0
        (["--tokens", "64", "--seq", "128"], "need --tokens >= --seq >= 1, got --tokens 64 --seq 128"),
        (["--device", "bogus"], "--device 'bogus' is not a device"),
        (["--device", "meta"], "--device meta: base_moe runs on cpu or cuda"),
    ],
)
def test_calibrate_argument_errors_before_loading(tmp_path, capsys, extra, message):
    """Bad values stop the command before the model loads (its directory is empty here: loading would fail)."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    empty_checkpoint(tmp_path / "model")
    argv = ["calibrate", "--model", str(tmp_path / "model"), "--text", str(text), "--out", str(tmp_path / "p"), *extra]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert message in str(exit_info.value.code) + capsys.readouterr().err


def test_an_empty_budget_list_is_an_argument_error(tmp_path, capsys):
    """--budgets "," is refused as an argument (it became an empty list, refused later as "need budgets")."""
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(tmp_path), "--text", "t", "--json", "o.json", "--budgets", ","])
    assert "--budgets: expected one or more comma-separated values, got ','" in capsys.readouterr().err


@pytest.mark.parametrize("policies, budgets, noted", [("oea,topk_reduce", ["--budgets", "4,5"], True),
                                                    ("dense", ["--budgets", "4,5"], True),
                                                    ("oea,router_sq", ["--budgets", "4,5"], False),
                                                    ("oea,topk_reduce", [], False)])
def test_budgets_no_policy_takes_are_noted(tmp_path, capsys, policies, budgets, noted):
    """--budgets with policies none of which takes a budget is said to be unused (it was dropped without a word);
    without --budgets there is nothing to note."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    empty_checkpoint(tmp_path / "model")
    argv = ["eval", "--model", str(tmp_path / "model"), "--text", str(text), "--json", str(tmp_path / "o.json"),
            "--policies", policies, *budgets]
    with pytest.raises(SystemExit):  # at the model's load (its directory is empty)
        main(argv)
    assert ("--budgets not applied" in capsys.readouterr().err) == noted


@pytest.mark.parametrize(
    "argv, message",
    [
        (["calibrate", "--text", "{missing}", "--out", "{tmp}/p"], "--text .* is not a file"),
        (["calibrate", "--text", "{text}", "--out", "{tmp}/no/p"], "--out .* does not exist"),
        (["calibrate", "--text", "{text}", "--out", "{tmp}"], "--out .* is a directory"),
        (["calibrate", "--text", "{text}", "--out", "{tmp}/no/"], "--out .* is a directory or empty"),
        (["eval", "--text", "{text}", "--json", "{tmp}/no/", "--policies", "router_sq"], "--json .* is a directory"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--predictors", "{garbage}"],
         "--predictors .*garbage.bin: not a readable safetensors file"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--policies", "router_sum", "--fill", "substitute"],
         "--fill substitute needs --predictors FILE calibrated with --similarity"),
        (["eval", "--text", "{text}", "--json", "{tmp}/no/o.json", "--policies", "router_sq"],
         "--json .* does not exist"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--predictors", "{missing}"],
         "--predictors .* not a file"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--policies", "router_sq", "--plot", "{tmp}/no/o.png"],
         "--plot .* does not exist"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--policies", "router_sq", "--seq", "16", "--prefill",
          "15"], "--prefill 15 leaves no scored decode position"),
        (["calibrate", "--text", "{text}", "--out", "{tmp}/p", "--model", "{tmp}/none"],
         "--model .* is not a directory"),
        (["calibrate", "--text", "{text}", "--out", "{tmp}/p", "--model", "{tmp}"], "--model .* has no config.json"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--policies", "router_sq", "--plot", "{tmp}/o.txt"],
         "--plot .*: matplotlib writes .*png"),
        (["calibrate", "--text", "{empty}", "--out", "{tmp}/p", "--bytes"], "gives 0 tokens, fewer than one sequence"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.json", "--policies", "router_sq", "--bytes", "--batch", "4",
          "--seq", "16", "--prefill", "4", "--batches", "1000"], "1000 batches of 4 x 16 tokens need 64000 tokens"),
        # an output that is an input or another output (the run overwrote one with the other)
        (["calibrate", "--text", "{text}", "--out", "{text}"], "--out .* is the file --text names too"),
        (["eval", "--text", "{text}", "--json", "{text}", "--policies", "router_sq"], "--json .* is the file --text"),
        (["eval", "--text", "{text}", "--json", "{tmp}/o.png", "--policies", "router_sq", "--plot", "{tmp}/o.png"],
         "--plot .* is the file --json names too"),
        (["eval", "--text", "{text}", "--json", "{pred}", "--predictors", "{pred}"],
         "--json .* is the file --predictors names too"),
        (["eval", "--text", "{text}", "--json", "{link}", "--policies", "router_sq"], "--json .* is the file --text"),
    ],
)
def test_paths_checked_before_loading(tmp_path, argv, message):
    """Input files must exist and output folders be writable before the model loads (its directory is empty)."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    empty_checkpoint(tmp_path / "model")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "garbage.bin").write_bytes(b"garbage, not safetensors")
    (tmp_path / "link.txt").symlink_to(text)  # another name of the text file
    Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(4)}, {0: torch.zeros(4)}).save(tmp_path / "p.safetensors")
    paths = {"tmp": str(tmp_path), "text": str(text), "missing": str(tmp_path / "missing"),
             "empty": str(tmp_path / "empty.txt"), "garbage": str(tmp_path / "garbage.bin"),
             "link": str(tmp_path / "link.txt"), "pred": str(tmp_path / "p.safetensors")}
    command, *rest = [arg.format(**paths) for arg in argv]
    argv = [command, "--model", str(tmp_path / "model"), *rest, "--device", "cpu"]  # a later --model wins
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_auto_dtype_is_float32_on_cpu():
    from base_moe.cli import model_dtype

    assert model_dtype("auto", "cpu") == "float32" and model_dtype("auto", "cuda:1") == "auto"
    assert model_dtype("bfloat16", "cpu") == "bfloat16"


def test_version(capsys):
    import base_moe

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"base_moe {base_moe.__version__}, torch {torch.__version__}; CUDA kernels ")


def test_eval_takes_the_models_shorter_context_and_a_broken_config_is_named(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    model = tmp_path / "model"
    empty_checkpoint(model, '{"max_position_embeddings": 128}')
    argv = ["eval", "--model", str(model), "--text", str(text), "--json", str(tmp_path / "o.json"), "--policies",
            "router_sq", "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_info:  # the folder holds no weights: loading fails, after the --seq check
        main(argv)
    message = str(exit_info.value.code) + capsys.readouterr().err
    assert "--seq" not in message and "context" not in message
    with pytest.raises(SystemExit, match="--seq 256 is longer than the model's context"):
        main([*argv, "--seq", "256"])
    (model / "config.json").write_text("[1, 2")
    with pytest.raises(SystemExit, match="config.json is not a readable JSON object"):
        main(argv)


def test_plot_format():
    from base_moe.cli import check_plot_format

    check_plot_format("out.png")
    check_plot_format("out.PNG")  # extensions in any case
    check_plot_format("out")  # no extension: matplotlib writes a PNG
    with pytest.raises(SystemExit, match="matplotlib writes .*svg"):
        check_plot_format("out.txt")


def test_cuda_device_without_cuda_is_refused(monkeypatch):
    from base_moe.cli import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device is available here"):
        resolve_device("cuda")
    assert resolve_device("cpu") == "cpu"
