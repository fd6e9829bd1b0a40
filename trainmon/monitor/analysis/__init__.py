"""Reading a run back: post-mortem, HTML report and plots, run comparison, live status view, budget arithmetic."""
