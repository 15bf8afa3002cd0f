"""Collective algorithms: which bytes go where in which step, written against small transport
interfaces so that every transport of the same shape reuses them."""
