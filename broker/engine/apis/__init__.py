"""The inbound APIs other than Chat Completions, translated to and from the chat form the engine runs."""
