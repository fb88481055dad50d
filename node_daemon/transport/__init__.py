"""Peer links and their wire: one link to each peer (``peer_transport``),
the framed link (``peer_frames``), Raft values in their protobuf form
(``wire``, ``batch_wire``) and snapshot transfer."""
