# session 15 call 5 (final): wip/select-replicated with 16-byte pushes. Tests and sanitizers, then bench_select with
# the replicated mode up to 16 tokens (the tree) and up to 8 (notes/select_replicated_8.patch); the faster at T = 16
# (one call + after a norm) stays built for bench_select (both models) and bench_layer (README's tables).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh tall selsan bsel 2>&1 | grep -v "^GPU\|^2.11"
mv $OUT/bench_select.json $OUT/bsel_16.json
git apply notes/select_replicated_8.patch && bash notes/device_trial.sh bsel 2>&1 | grep "qwen3\|build"
mv $OUT/bench_select.json $OUT/bsel_8.json
choice=$(python3 - <<'PY'
import json, os
def t16(name):
    row = next(r for r in json.load(open(f"{os.environ['OUT']}/{name}"))["rows"] if r["T"] == 16)
    return row["select_experts_us"] + row["select_experts_after_norm_us"]
print(8 if t16("bsel_8.json") < t16("bsel_16.json") - 0.2 else 16)
PY
)
echo "replicated up to $choice tokens"
if [ "$choice" = 16 ]; then git apply -R notes/select_replicated_8.patch; else export BASE_MOE_COMMIT="$(cat .trial_sha) + notes/select_replicated_8.patch"; fi
bash notes/device_trial.sh bselall layer 2>&1 | grep -v "^GPU\|^2.11"
cd $OUT && gzip -q *.log 2>/dev/null; rm -f build.log.gz; ls
