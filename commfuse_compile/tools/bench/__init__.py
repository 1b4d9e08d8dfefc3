"""``commfuse bench``: every schedule measured on local gloo ranks behind throttled links
(``run``: the presets and the run; ``netns``: the links)."""
