"""Tests only: on PYTHONPATH of a command run by tests.distributed.run_cli, every Python process the command
starts (launcher, ranks, DataLoader workers, spawned helpers) writes every thread's stack to its stderr on
STACKS_SIGNAL, and goes on. A command that runs past its timeout is asked for them before it is killed, so
the failure says where each process was (a hang) instead of naming only the command."""

import faulthandler
import signal

STACKS_SIGNAL = signal.SIGUSR2   # hetrain takes SIGTERM and SIGUSR1 (a scheduler's warning); nothing takes SIGUSR2

faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
