"""How requests move between subservers: typed messages, and the transports that carry them."""
