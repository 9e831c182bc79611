"""What a model's text means: reasoning spans, tool calls and constrained (structured) output."""
