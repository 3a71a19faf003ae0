"""One module per collective: prepare the call, start it on the engine, wrap the result."""
