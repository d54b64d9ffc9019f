"""Routing: the routers, replay of recorded choices, the counts of what they chose, the load-balancing and z-losses."""
