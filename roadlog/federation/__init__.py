"""Federation's client side (issue 43, docs/federation.md): a topic's home
and the redirect that names it (``home``), and the directory's client
(``directory``). Protocol only, like the rest of the SDK."""
