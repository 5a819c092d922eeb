"""A fake trainer rank (tests/test_procs_parent.py): it asks to die with its torchrun agent as every
rank does (trainer.launch.die_with_agent), then says it is still alive."""

from trainer.launch import die_with_agent

die_with_agent()
print("rank alive", flush=True)
