"""The nemesis: fault injection against real roadlog clusters in network
namespaces, with a recorded history and a checker over it (issue 21).

``schedule`` draws a replayable fault schedule from a seed; ``cluster``
runs nodes and queue servers as hosts on a bridge the run makes and
removes; ``faults`` injects and heals; ``workload`` drives producers,
consumers and topic churn and records every operation through
``history``; ``checker`` judges the history; ``run`` ties them together
(``make nemesis SECONDS=N SEED=S``).
"""
