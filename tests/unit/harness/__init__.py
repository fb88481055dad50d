"""Unit tests of the test harness itself: tier budgets, the bridge lock, the
nemesis, bench figures."""
