"""The processes that run a campaign's examples, and how they end."""
