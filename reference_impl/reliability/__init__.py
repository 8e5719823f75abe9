"""What keeps a run alive or names what went wrong: the process lifecycle (launcher death,
preemption), fault injection and the watchdog, stragglers and non-finite losses."""
