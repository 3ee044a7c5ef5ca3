"""What the daemon listens on and what bounds it: control socket, fd channel, runtime dir, fd and memory budgets."""
