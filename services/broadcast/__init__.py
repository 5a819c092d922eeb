"""services/broadcast"""
