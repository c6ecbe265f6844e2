"""`ray job submit` entrypoint for drafter training (same flags as `eagle3-ray train`).

    ray job submit --working-dir . -- python jobs/train.py \
        --dataset /tmp/hs --output /tmp/train --ttt-steps 8 --max-steps 1000 --num-workers 2
    ray job submit --working-dir . -- python jobs/train.py --online \
        --inputs embedded:sharegpt --limit 1000 --output /tmp/online --replicas 1
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3_ray.cli import add_train_args, cmd_train  # noqa: E402
from eagle3_ray.launch import job_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(job_main("Train the EAGLE-3 drafter (Ray Train), offline or --online.",
                      add_train_args, cmd_train))
