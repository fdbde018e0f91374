"""The runs of a session: who joined (membership), how far each may run ahead (credits), and halting them."""
