# session 57 call 1: the timings session 56 could not take (README's selection table with the behind-a-norm columns,
# route_warps8 and sigmoid_double on main; README's layer table with the new norm fields)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash notes/device_trial.sh bselall layerq | grep -v "^[0-9.]*+\|^GPU"
