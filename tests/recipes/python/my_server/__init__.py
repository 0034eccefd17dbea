"""Stand-in for a user's server package, for the README recipe test."""
