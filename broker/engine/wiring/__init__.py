"""Wiring: `assemble` builds the engine from settings, `reload` swaps in a new one, `upstreams` builds the pools' parts."""
