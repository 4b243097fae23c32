"""What a machine or an image can run, checked three ways, from the cheapest:

doctor    versions, devices, the patches' targets and the job-key guard, read in seconds (`ogrpo doctor`)
selftest  a short real run of the stack this machine has: the plan's server and trainer, a few GRPO steps
          (`ogrpo selftest`, `--gpu` on a GPU node)
image     the GPU image's build-time self-check (the last Dockerfile step: `python -m ogrpo.checks.image`)

Each reports one line per problem and exits non-zero on any; importing this package imports nothing heavy.
"""
