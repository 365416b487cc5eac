"""`verispec run-batch`: an OpenAI batch file answered by the server's own app, in one process
or over Ray Data."""
