"""`python -m ogrpo.launch.slurm step|supervise ...`: the commands rendered job.sbatch files run (the batch step
`exec`s `supervise JOB_DIR`; each srun step runs `step`), kept word for word since the slurm.py module became this
package."""

import sys

from ogrpo.launch.slurm import _step_main, _supervise_main

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "step":
        sys.exit(_step_main(sys.argv[2:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "supervise":
        sys.exit(_supervise_main(sys.argv[2:]))
    else:
        raise SystemExit("usage: python -m ogrpo.launch.slurm step|supervise ...")
