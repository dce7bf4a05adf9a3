"""Llama-family models: spec, layers, decoder, loader, the embedded tiny model."""
