#!/usr/bin/env bash
cd /app
mv draft.txt final.txt
