"""What the runtime's processes say to each other over the broker: documents and final-model shares."""
