"""Built-in behaviour, written as ordinary plugins (each can be disabled by its name)."""
