"""Fault drills against real processes: the server, and prefill ranks' landing memory, each in
a process of its own that can be paused, killed or cut off, and the soak that runs them."""
