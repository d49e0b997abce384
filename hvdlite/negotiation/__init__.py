"""What the ranks agree on before any data moves: the requests (``requests``), the
coordinator that matches them (``coordinator``), the response cache, and the process
sets with their agreed membership."""
