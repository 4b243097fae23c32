"""The planner's steps (ogrpo/plan.py runs them in order; ogrpo/plan.py is the public API):

device_rules     every decision that differs per device kind (CPU, each GPU family's facts)
placement        where vLLM and the trainer run (mode, tensor/data parallel sizes, devices)
batch            TRL's batch rules for the plan's trainer processes
strategy         memory fit: vLLM's share, then the cheapest trainer strategy that fits
settings         precision, attention, trainer arguments, environment, vLLM arguments, each with its reason
input_changes    what the plan-time input checks changed in the recipe (handed in: they read files), as changes
sandbox_opt_out  the recipe's `ogrpo.sandbox: none` with code rewards: a change and a warning
preemption       the preemption policy from the cluster's facts (handed in: the command asks scontrol): the
                 signal lead time, save_steps (a change) and its warnings
fixes            suggested fixes, kept only when a re-plan with them applied fits
types            the Plan object and its typed sections
"""
