"""Decode loops: the AR baseline and chain speculative decoding, both kept on the device."""
