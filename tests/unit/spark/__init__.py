"""Unit tests of the Spark jobs' pieces that need no Spark (spark)."""
