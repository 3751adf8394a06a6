set -o pipefail; mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
EV="--upscales 0 --vsa 0 --device cuda"
python benchmarks/toy_eval.py --captions 20 --edits 4 --extensions 2 $EV --out $OUT/toy_eval_h200_run29_guided.json > $OUT/a.log 2>&1 &
python benchmarks/toy_eval.py --captions 40 --edits 0 --extensions 0 $EV --out $OUT/toy_eval_h200_run29_guided_40.json > $OUT/b.log 2>&1 &
python benchmarks/toy_eval.py --captions 40 --edits 0 --extensions 0 --guidance 1 $EV --out $OUT/toy_eval_h200_run29_plain_40.json > $OUT/c.log 2>&1 &
wait
for f in $OUT/*.json; do python3 -c "
import json;d=json.load(open('$f'))['summary'];print('$f'.split('/')[-1], *[f'{k}={d.get(k)}' for k in ('t2va_named_checks','t2va_colour','t2va_motion','fl2va_first_frame_psnr_median','removal_all_checks','replace_all_checks','replace_kept_sound_all_checks','repaint_all_checks','extension_velocity','extension_no_jump','wall_s','guidance')])"; done
