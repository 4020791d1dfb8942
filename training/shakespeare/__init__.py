"""The demonstration data built from tinyshakespeare: tasks, chat dialogues, tool-calling conversations."""
